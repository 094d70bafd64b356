"""The generation backends of `rl.backend`: transformers' `generate` on the HF replica against the native
sampler (greedy tokens, sampled log-probs), policy versions on completions, and the section's config rules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fastlm.config.errors import ConfigError
from fastlm.data.tokenizer import ByteTokenizer
from fastlm.generation import NativeBackend, SamplingOptions
from fastlm.generation.backend_config import NativeBackendConfig, TransformersBackendConfig
from fastlm.generation.hf_backend import TransformersBackend
from fastlm.generation.sampling import next_token_logprobs
from fastlm.lora.attach import merged_weights
from fastlm.rl.checks import backend_issues
from fastlm.rl.config import RLConfig
from fastlm.run_config.loader import load_config
from tests.rl.rl_helpers import tiny_model

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

TOKENIZER = ByteTokenizer()
PROMPTS = [TOKENIZER.encode(text, bos=True) for text in ("ab", "hello w", "1+2=")]


def _backends() -> tuple[NativeBackend, TransformersBackend]:
    model = tiny_model(seed=4).eval()
    native = NativeBackendConfig(generation="static").build(model, TOKENIZER, None, multi_turn=False)
    hf = TransformersBackendConfig().build(model, TOKENIZER, None, multi_turn=False)
    for backend in (native, hf):
        backend.sync_weights(merged_weights(model), 7)
    return native, hf


def test_transformers_greedy_tokens_equal_the_native_backends() -> None:
    native, hf = _backends()
    options = SamplingOptions(8, temperature=0.0, stop_tokens=(TOKENIZER.eos_id,))
    ours, theirs = native.generate(PROMPTS, options), hf.generate(PROMPTS, options)
    assert [c.tokens for c in theirs] == [c.tokens for c in ours]
    assert [c.stopped for c in theirs] == [c.stopped for c in ours]
    gap = max(abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x.logprobs, y.logprobs))
    print(f"greedy log-prob gap transformers vs native: {gap:.2e}")
    assert gap < 1e-5
    assert {c.policy_version for c in ours + theirs} == {7}


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(1.0, 1.0, 0), (0.7, 0.9, 20)])
def test_transformers_sampled_logprobs_are_the_sampling_distributions(temperature: float, top_p: float,
                                                                       top_k: int) -> None:
    """Each drawn token's log-prob is its log-prob under the native sampler's distribution (temperature, top-k,
    top-p) given the same prefix: the same distribution, recomputed from the policy model. Filters off are off
    (generate's own default is top_k 50)."""
    native, hf = _backends()
    options = SamplingOptions(6, temperature=temperature, top_p=top_p, top_k=top_k)
    completions = hf.generate(PROMPTS, options, torch.Generator().manual_seed(1))
    again = hf.generate(PROMPTS, options, torch.Generator().manual_seed(1))
    assert [c.tokens for c in again] == [c.tokens for c in completions]  # the caller's generator seeds the draws
    model = native.generator.model
    worst = 0.0
    for prompt, completion in zip(PROMPTS, completions):
        sequence = torch.tensor([prompt + completion.tokens])
        with torch.no_grad():
            logits = model.logits(sequence)[0, len(prompt) - 1 : -1]
        want = next_token_logprobs(logits, options).gather(1, torch.tensor(completion.tokens)[:, None]).squeeze(1)
        assert bool(torch.isfinite(want).all())  # never a token outside top-k / top-p
        worst = max(worst, float((torch.tensor(completion.logprobs) - want).abs().max()))
    print(f"sampled log-prob gap transformers vs native distribution: {worst:.2e}")
    assert worst < 1e-5


def test_sync_weights_updates_the_replica_and_the_version() -> None:
    native, hf = _backends()
    model = native.generator.model
    options = SamplingOptions(6, temperature=0.0)
    before = hf.generate(PROMPTS, options)
    with torch.no_grad():
        model.output_weight.mul_(-1.0)
    assert [c.tokens for c in hf.generate(PROMPTS, options)] == [c.tokens for c in before]  # not synced yet
    hf.sync_weights(merged_weights(model), 8)
    after = hf.generate(PROMPTS, options)
    assert [c.tokens for c in after] == [c.tokens for c in native.generate(PROMPTS, options)]
    assert [c.tokens for c in after] != [c.tokens for c in before]
    assert {c.policy_version for c in after} == {8}


def test_a_missing_backend_package_is_refused() -> None:
    class Uninstalled(TransformersBackendConfig):
        requires = ("fastlm_no_such_backend_package",)

    issues = backend_issues(Uninstalled())
    assert len(issues) == 1 and issues[0].path == "rl.backend.type"
    assert "fastlm_no_such_backend_package, which is not installed" in str(issues[0])
    assert backend_issues(TransformersBackendConfig()) == [] and backend_issues(NativeBackendConfig()) == []


def test_backend_section_rules() -> None:
    assert RLConfig().backend == NativeBackendConfig()
    assert RLConfig(backend={"generation": "static"}).backend.generation == "static"  # no type: native
    assert RLConfig(backend={"type": "transformers"}).backend.type == "transformers"
    with pytest.raises(ValueError, match=r"rl.decode_slots moved to rl.backend.decode_slots"):
        RLConfig(decode_slots=8)
    with pytest.raises(ValueError, match="no multi-turn session"):
        RLConfig(backend={"type": "transformers"}, environment={"name": "tool_arithmetic"})
    with pytest.raises(ValueError, match="cannot record it"):
        RLConfig(backend={"type": "transformers"}, routing_replay=True)
    with pytest.raises(ValueError, match="does not cover rl.environment"):
        RLConfig(routing_replay=True, environment={"name": "tool_arithmetic"})
    assert RLConfig(routing_replay=True).routing_replay


def test_an_old_top_level_knob_names_its_new_place() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(CONFIGS / "grpo.yaml", ["rl.cuda_graph=false"])
    (line,) = [str(issue) for issue in caught.value.issues]
    assert line.startswith("rl: rl.cuda_graph moved to rl.backend.cuda_graph") and "cuda_graph: false}" in line


def test_routing_replay_is_refused_for_a_dense_model() -> None:
    with pytest.raises(ConfigError, match="rl.routing_replay: replays the routing of MoE layers"):
        load_config(CONFIGS / "grpo.yaml", ["rl.routing_replay=true"])


def test_the_transformers_backend_is_refused_where_no_hf_replica_can_be_built() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(CONFIGS / "grpo.yaml", ["rl.backend.type=transformers", "model.head.softcap=30.0",
                                            "distributed.tensor_parallel=2"])
    lines = [str(issue) for issue in caught.value.issues]
    print(lines)
    assert any(line.startswith("model.head.softcap: the HF architecture has no such logit softcap") for line in lines)
    assert any(line.startswith("rl.backend.type: the transformers backend's replica holds the whole vocab")
               for line in lines)
