"""The generator's sampling: filters vs a float64 reference, log-probs vs a float64 forward, seeds, stops,
bad requests. The CUDA paths (graph, compile, FlexAttention decode) are in test_generator_cuda.py."""

from __future__ import annotations

import copy

import pytest
import torch

from fastlm.data.tokenizer import BOS, EOS, ByteTokenizer
from fastlm.generation import Generator, SamplingOptions, generate
from fastlm.generation.sampling import next_token_distribution
from fastlm.models.config import LlamaConfig
from fastlm.models.decoder import build_model
from tests.rl.rl_helpers import reference_logprobs, rel_err, tiny_model

TOKENIZER = ByteTokenizer()


def _filter_reference(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    scaled = logits.double() / temperature
    if top_k:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    out = torch.zeros_like(probs)
    for row in range(probs.shape[0]):
        mass = 0.0
        for index in probs[row].argsort(descending=True).tolist():
            if mass >= top_p:
                break
            out[row, index] = probs[row, index]
            mass += float(probs[row, index])
    return out / out.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 0.5, 0), (1.0, 0.95, 7)])
def test_sampling_distribution_matches_reference(temperature: float, top_p: float, top_k: int) -> None:
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(3)) * 2
    got = next_token_distribution(logits, SamplingOptions(1, temperature, top_p, top_k))
    want = _filter_reference(logits, temperature, top_p, top_k)
    print(f"T={temperature} top_p={top_p} top_k={top_k}: rel err {rel_err(got, want):.2e}, kept {(got > 0).sum(1).tolist()}")
    assert rel_err(got, want) < 1e-5
    assert torch.equal(got > 0, want > 0)


def test_draws_follow_the_distribution() -> None:
    """The inverse-CDF pick on hashed uniforms picks token i with probability p_i: frequencies over many
    sequences (seeds) and over many draws of one sequence (steps) match."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]]).expand(20000, 5)
    options = SamplingOptions(1, temperature=0.8, top_p=0.9)
    from fastlm.generation.sampling import draw_uniforms, pick_tokens, sequence_seeds

    seeds = sequence_seeds(20000, torch.Generator().manual_seed(0), torch.device("cpu"))
    want = next_token_distribution(logits[:1], options)[0]
    one_sequence = pick_tokens(logits, options, draw_uniforms(seeds[:1].expand(20000), torch.arange(20000)))[0]
    choice, logprob = pick_tokens(logits, options, draw_uniforms(seeds, torch.tensor(3)))
    for name, picked in (("over steps", one_sequence), ("over seeds", choice)):
        seen = torch.bincount(picked, minlength=5).double() / len(picked)
        print(f"frequencies {name} {seen.tolist()} vs {want.tolist()}")
        assert (seen - want).abs().max() < 0.015
    assert torch.allclose(logprob, want.log()[choice])


@pytest.mark.parametrize(("scale", "softcap", "temperature"), [(1.0, None, 1.0), (1.7, 2.5, 0.7)])
def test_sampled_logprobs_match_float64_forward(scale: float, softcap: float | None, temperature: float) -> None:
    """The sampler's log-probs are those of the tempered softmax of the training forward (no top-p here)."""
    model = tiny_model()
    prompts = [TOKENIZER.encode(text, bos=True) for text in ("1+2=", "7+8=", "ab>", "3+3=")]
    options = SamplingOptions(6, temperature, stop_tokens=(EOS,), logit_scale=scale, softcap=softcap)
    completions = generate(model, prompts, options, TOKENIZER, torch.Generator().manual_seed(0))
    assert model.training  # mode restored
    worst = 0.0
    for prompt, completion in zip(prompts, completions):
        assert 1 <= len(completion.tokens) <= 6 and len(completion.logprobs) == len(completion.tokens)
        assert completion.stopped == (completion.tokens[-1] == EOS) and EOS not in completion.tokens[:-1]
        want = reference_logprobs(model, prompt + completion.tokens, len(prompt), scale / temperature,
                                  None if softcap is None else softcap / temperature)
        worst = max(worst, rel_err(torch.tensor(completion.logprobs), want))
    print(f"sampler log-probs (scale {scale}, softcap {softcap}, T {temperature}) vs float64 forward: max rel err {worst:.2e}")
    assert worst < 1e-4


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_padded_vocab_draws_only_what_the_tokenizer_decodes(temperature: float) -> None:
    """A model vocab padded past the tokenizer's (300 vs the byte tokenizer's 260), its head biased towards the
    padding ids: the sampler draws only decodable ids, with log-probs of the softmax over those ids alone."""
    torch.manual_seed(0)
    model = build_model(LlamaConfig(vocab_size=300, hidden_size=32, num_layers=1, num_heads=2, max_seq_len=48,
                                    init_std=0.2, tie_embeddings=False))
    with torch.no_grad():
        model.lm_head_weight[TOKENIZER.vocab_size:] *= 20  # padding ids would win most draws
    prompts = [TOKENIZER.encode(text, bos=True) for text in ("1+2=", "ab>")]
    with torch.no_grad():
        assert int(model.logits(torch.tensor([prompts[0]]))[0, -1].argmax()) >= TOKENIZER.vocab_size
    completions = generate(model, prompts, SamplingOptions(6, temperature), TOKENIZER, torch.Generator().manual_seed(0))
    model64, worst = copy.deepcopy(model).double(), 0.0
    for prompt, completion in zip(prompts, completions):
        assert max(completion.tokens) < TOKENIZER.vocab_size
        TOKENIZER.decode(completion.tokens)  # decodes (an id past the vocab raises)
        sequence = torch.tensor([prompt + completion.tokens])
        with torch.no_grad():
            logits = model64.logits(sequence)[0, len(prompt) - 1:-1, : TOKENIZER.vocab_size]
        want = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(completion.tokens)[:, None]).squeeze(-1)
        worst = max(worst, rel_err(torch.tensor(completion.logprobs), want))
    print(f"padded vocab, T {temperature}: log-probs vs float64 softmax over decodable ids: max rel err {worst:.2e}")
    assert worst < 1e-4


def test_sampling_is_seeded_and_stops() -> None:
    model = tiny_model()
    prompts = [[BOS, 50, 43, 50, 61]] * 8
    options = SamplingOptions(5, temperature=1.0, stop_tokens=(EOS,))
    first = generate(model, prompts, options, TOKENIZER, torch.Generator().manual_seed(11))
    again = generate(model, prompts, options, TOKENIZER, torch.Generator().manual_seed(11))
    other = generate(model, prompts, options, TOKENIZER, torch.Generator().manual_seed(12))
    assert [c.tokens for c in first] == [c.tokens for c in again]
    assert [c.tokens for c in first] != [c.tokens for c in other]
    # greedy picks the argmax; with that token as a stop token every completion ends right there
    with torch.no_grad():
        logp = torch.log_softmax(model.logits(torch.tensor([prompts[0]]))[0, -1], dim=-1)
    expected = int(logp.argmax())
    greedy = generate(model, prompts, SamplingOptions(5, temperature=0.0, stop_tokens=(EOS, expected)), TOKENIZER)
    assert all(c.tokens == [expected] and c.stopped for c in greedy)
    assert greedy[0].logprobs[0] == pytest.approx(float(logp[expected]), abs=1e-5)


def test_finished_rows_are_padded_and_generation_ends_early() -> None:
    """Rows stop independently; once all have stopped the loop ends at the next check."""
    model = tiny_model()
    prompts = [TOKENIZER.encode(t, bos=True) for t in ("1+2=", "9+9=", "ab>")]
    with torch.no_grad():
        first = [int(model.logits(torch.tensor([p]))[0, -1].argmax()) for p in prompts]
    engine = Generator(model, TOKENIZER, check_every=2)
    calls = []
    original = engine._decode_step

    def counting(*args):
        step = original(*args)
        forward = step.run
        step.run = lambda: (calls.append(1), forward())[1]
        return step

    engine._decode_step = counting
    out = engine.generate(prompts, SamplingOptions(40, temperature=0.0, stop_tokens=tuple(set(first))))
    assert [c.tokens for c in out] == [[t] for t in first] and all(c.stopped for c in out)
    assert len(calls) == 1  # every row stopped at its first token: the check after the 2nd pick ends it, not 39 steps


def test_bad_requests_are_named() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match=r"prompt 1 has 45 tokens, more than model.max_seq_len \(48\)"):
        generate(model, [[BOS], [BOS] * 45], SamplingOptions(max_new_tokens=4), TOKENIZER)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        generate(model, [[]], SamplingOptions(max_new_tokens=4), TOKENIZER)
    with pytest.raises(ValueError, match="outside"):
        generate(model, [[BOS, 999]], SamplingOptions(max_new_tokens=4), TOKENIZER)
    with pytest.raises(ValueError, match="stop tokens"):
        generate(model, [[BOS]], SamplingOptions(4, stop_tokens=(300,)), TOKENIZER)
    with pytest.raises(ValueError, match="top_p"):
        SamplingOptions(4, top_p=0.0)


def test_a_failing_flex_or_compiled_step_falls_back_to_sdpa(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """A compiler error while building the step (its warm-up, on the graph path) is said in one line and
    generation continues without compile, with SDPA: the same tokens as that path."""
    import fastlm.generation.generator as generator_module

    class FailingFlexStep(generator_module._DecodeStep):
        def __init__(self, model, cache, *args) -> None:
            if cache.decode_attention == "flex":
                raise RuntimeError("inductor could not lower flex_decoding\nsecond line")
            super().__init__(model, cache, *args)

    monkeypatch.setattr(generator_module, "_DecodeStep", FailingFlexStep)
    model = tiny_model()
    prompts = [TOKENIZER.encode(t, bos=True) for t in ("1+2=", "ab>")]
    options = SamplingOptions(5, temperature=0.0)
    engine = Generator(model, TOKENIZER, decode_attention="flex")
    got = engine.generate(prompts, options)
    assert "failed (RuntimeError: inductor could not lower flex_decoding); generating without compile, with SDPA" \
        in capsys.readouterr().err
    assert (engine.decode_attention, engine.compile) == ("sdpa", False)
    assert [c.tokens for c in got] == [c.tokens for c in generate(model, prompts, options, TOKENIZER)]
