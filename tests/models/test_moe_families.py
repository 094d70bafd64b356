"""The MoE families against transformers on tiny random configs it builds locally (no downloads): logits in
fp32, each layer's chosen experts and router probabilities (as per-expert counts and sums), the balance
loss against transformers' `aux_loss`, export then reload with equal logits, greedy generation token for
token, the weight rules' coverage and the analytic total / active parameter counts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from fastlm.commands.main import main
from fastlm.data.tokenizer import ByteTokenizer
from fastlm.generation import SamplingOptions, generate
from fastlm.layers.moe import MoEMLP, load_balancing_loss
from fastlm.models import active_parameters, count_parameters, num_parameters
from fastlm.models.decoder import build_model
from fastlm.models.hf import config_from_hf, export_hf, import_hf, weight_rules
from tests.models.model_helpers import center_offset_norms, randomize_weights, saved_pretrained

VOCAB, SEQ = 300, 12
ATTENTION = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "num_experts_per_tok": 2}
HYBRID = {"head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
          "linear_value_head_dim": 8, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 20}
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**ATTENTION, "intermediate_size": 24, "num_local_experts": 6,
                                                        "router_aux_loss_coef": 0.02}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**ATTENTION, "head_dim": 16, "intermediate_size": 40,
                                                            "moe_intermediate_size": 24, "num_experts": 6,
                                                            "norm_topk_prob": True, "mlp_only_layers": [1]}),
    "qwen3_moe-unnormalised": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**ATTENTION, "moe_intermediate_size": 24,
                                                                         "num_experts": 6, "norm_topk_prob": False}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {**ATTENTION, "intermediate_size": 24, "num_experts": 6,
                                                  "norm_topk_prob": False}),
    "olmoe-renormalised": ("OlmoeConfig", "OlmoeForCausalLM", {**ATTENTION, "intermediate_size": 24, "num_experts": 6,
                                                               "norm_topk_prob": True}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {**ATTENTION, "intermediate_size": 40, "num_experts": 6,
                                                            "moe_intermediate_size": 24,
                                                            "shared_expert_intermediate_size": 20,
                                                            "norm_topk_prob": False, "mlp_only_layers": [0]}),
    # hybrid Gated DeltaNet + gated attention, experts + sigmoid-gated shared expert (fastlm's qwen3_5 family)
    "qwen3_5-moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {**ATTENTION, **HYBRID, "num_experts": 6,
                                                                      "layer_types": ["linear_attention",
                                                                                      "full_attention"]}),
    "qwen3_5-next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {**ATTENTION, **HYBRID, "num_experts": 6,
                                                                 "norm_topk_prob": False, "intermediate_size": 40,
                                                                 "layer_types": ["full_attention", "linear_attention"],
                                                                 "mlp_only_layers": [1]}),
}


def _hf_model(kind: str) -> torch.nn.Module:
    config_name, model_name, fields = FAMILIES[kind]
    config = getattr(transformers, config_name)(**fields)
    config._attn_implementation = "eager"
    model = getattr(transformers, model_name)(config).eval()
    randomize_weights(model, seed=sum(map(ord, kind)), scale=0.2)
    if kind.startswith("qwen3_5"):
        center_offset_norms(model)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    return saved_pretrained(tmp_path_factory.mktemp, FAMILIES, _hf_model)


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def _moe_layers(model: torch.nn.Module) -> list[MoEMLP]:
    return [module for module in model.modules() if isinstance(module, MoEMLP)]


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_import_matches_transformers(kind: str, saved: dict[str, tuple[torch.nn.Module, Path]]) -> None:
    """Logits (fp32), per layer the experts chosen (counts) and the router probabilities (sums), and the aux loss."""
    reference, directory = saved[kind]
    model = import_hf(directory).eval()
    assert model.config.type == kind.split("-")[0]
    ids = _ids(1)
    with torch.no_grad():
        ours = model.logits(ids)
        theirs = reference(ids, output_router_logits=True)
    diff = float((ours - theirs.logits).abs().max())
    sums = [layer.router_sums for layer in _moe_layers(model)]
    top_k = reference.config.num_experts_per_tok
    for ours_sums, router_logits in zip(sums, theirs.router_logits, strict=True):
        probs = router_logits.float().softmax(-1)
        counts = torch.zeros_like(ours_sums.counts).scatter_add_(
            0, probs.topk(top_k, -1).indices.reshape(-1), torch.ones(probs.shape[0] * top_k))
        assert torch.equal(ours_sums.counts, counts)
        torch.testing.assert_close(ours_sums.probs, probs.sum(0), rtol=1e-5, atol=1e-6)
    aux = float(load_balancing_loss(sums))
    print(f"{kind}: fp32 logits max abs diff {diff:.2e}; aux loss {aux:.6f} vs transformers {float(theirs.aux_loss):.6f}")
    assert diff <= 1e-5
    assert abs(aux - float(theirs.aux_loss)) <= 1e-6 * abs(float(theirs.aux_loss))


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_export_reloads_in_transformers(kind: str, saved: dict[str, tuple[torch.nn.Module, Path]], tmp_path: Path) -> None:
    reference, directory = saved[kind]
    model = import_hf(directory).eval()
    exported = export_hf(model, tmp_path / "exported", ByteTokenizer())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported, attn_implementation="eager").eval()
    assert type(reloaded) is type(reference)
    assert config_from_hf(reloaded.config.to_dict()) == model.config.model_copy(update={"head": config_from_hf(
        reloaded.config.to_dict()).head})
    ids = _ids(3)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("kind", ["mixtral", "olmoe", "qwen3_moe", "qwen2_moe", "qwen3_5-moe", "qwen3_5-next"])
def test_greedy_generation_equals_transformers(kind: str, saved: dict[str, tuple[torch.nn.Module, Path]]) -> None:
    """fastlm's KV-cache generator and transformers' greedy `generate`, token for token, two prompt lengths. The
    model's vocab (300) is padded past the byte tokenizer's (260): fastlm draws only ids the tokenizer decodes,
    which is transformers' `generate` with the padding ids suppressed."""
    reference, directory = saved[kind]
    model = import_hf(directory).eval()
    options = SamplingOptions(8, temperature=0.0, stop_tokens=())
    padding = list(range(ByteTokenizer().vocab_size, VOCAB))
    for prompt in ([5, 17, 250, 3], [9, 1, 2, 3, 4, 5, 6, 7, 8]):
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                          max_new_tokens=8, do_sample=False, suppress_tokens=padding)[0, len(prompt):].tolist()
        [completion] = generate(model, [prompt], options, ByteTokenizer(), torch.Generator())
        print(f"{kind} {prompt}: transformers {expected} fastlm {completion.tokens}")
        assert completion.tokens == expected and len(set(expected)) > 1


@pytest.mark.parametrize("preset", ["mixtral-tiny", "olmoe-1b-7b", "qwen3-moe-tiny", "deepseek-v3-tiny",
                                    "moonlight-16b-a3b"])
def test_sizing_and_rules(preset: str) -> None:
    """Analytic counts equal the built model's; the rules name every tensor; `fastlm validate` prints the
    total and active counts; OLMoE-1B-7B has its published 6.92B parameters, 1.28B active per token."""
    import yaml

    from fastlm.commands.validate import describe_run
    from fastlm.run_config.loader import load_config
    from fastlm.run_config.schema import RunConfig

    path = Path(__file__).resolve().parents[2] / "configs" / "presets" / f"{preset}.yaml"
    config = RunConfig.model_validate(yaml.safe_load(path.read_text())).model
    model = build_model(config, "meta")
    assert count_parameters(model) == num_parameters(config)
    assert {rule.ours for rule in weight_rules(config)} == set(model.state_dict())
    assert active_parameters(config) < num_parameters(config)
    printed = describe_run(load_config(path))  # validate's report (its memory check refuses 7B on a small machine)
    assert f"{num_parameters(config):,} parameters" in printed
    assert f"{active_parameters(config):,} active per token" in printed
    if preset == "olmoe-1b-7b":
        assert round(num_parameters(config) / 1e9, 2) == 6.92 and round(active_parameters(config) / 1e9, 2) == 1.28


def test_cli_convert_train_generate_export(saved: dict[str, tuple[torch.nn.Module, Path]], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A tiny HF Qwen3-MoE folder through `fastlm convert --from-hf`, `train` (the router losses logged),
    `generate` and `convert --to-hf`, which transformers loads as the same architecture."""
    import json

    from fastlm.logging.jsonl import read_metrics

    reference, directory = saved["qwen3_moe"]
    assert main(["convert", "--from-hf", str(directory), "--to", str(tmp_path / "fastlm")]) == 0
    run = tmp_path / "run"
    assert main(["train", str(tmp_path / "fastlm" / "model.yaml"), f"run.output_dir={run}", "run.name=moe",
                 "data.seq_len=16", "data.micro_batch_size=2", "trainer.steps=2", "trainer.log_every=1",
                 "trainer.eval_every=0", "trainer.checkpoint_every=0", "logging.wandb.enabled=false",
                 "logging.progress=false", "model.moe.z_loss_coef=0.001"]) == 0
    records = read_metrics(run / "metrics.jsonl")
    assert all({"train/loss/moe_aux", "train/loss/moe_router_z", "train/moe/layer0/idle_experts"} <= set(r)
               for r in records) and len(records) == 2
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "ab", "--max-new-tokens", "4", "--temperature", "0",
                 "--device", "cpu", "--jsonl"]) == 0
    assert len([json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]) == 1
    assert main(["convert", "--from", str(run), "--to-hf", str(tmp_path / "back")]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert type(reloaded) is type(reference)


@pytest.mark.parametrize(("config_name", "fields", "field"), [
    ("MixtralConfig", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ("OlmoeConfig", {"clip_qkv": 8.0}, "clip_qkv"),
    ("Qwen3MoeConfig", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
])
def test_unsupported_options_name_the_field(config_name: str, fields: dict[str, Any], field: str) -> None:
    from fastlm.config.errors import ConfigError

    hf = getattr(transformers, config_name)(**ATTENTION).to_dict() | fields
    with pytest.raises(ConfigError, match=field):
        config_from_hf(hf)
