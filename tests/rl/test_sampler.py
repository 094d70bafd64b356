"""Sampler: nucleus filtering, log-probs vs a float64 forward (with the head's logit transform), stop, seeds."""

from __future__ import annotations

import pytest
import torch

from fastlm.data.tokenizer import BOS, EOS, PAD, ByteTokenizer
from fastlm.rl.sampler import SamplingOptions, next_token_distribution, sample_completions
from tests.rl.rl_helpers import reference_logprobs, rel_err, tiny_model


def _top_p_reference(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    out = torch.zeros_like(probs)
    for row in range(probs.shape[0]):
        mass = 0.0
        for index in probs[row].argsort(descending=True).tolist():
            if mass >= top_p:
                break
            out[row, index] = probs[row, index]
            mass += float(probs[row, index])
    return out / out.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5)])
def test_next_token_distribution_matches_reference(temperature: float, top_p: float) -> None:
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(3)) * 2
    got = next_token_distribution(logits, temperature, top_p)
    want = _top_p_reference(logits, temperature, top_p)
    print(f"T={temperature} top_p={top_p}: rel err {rel_err(got, want):.2e}, kept {(got > 0).sum(1).tolist()}")
    assert rel_err(got, want) < 1e-5
    assert torch.equal(got > 0, want > 0)


@pytest.mark.parametrize(("scale", "softcap"), [(1.0, None), (1.7, 2.5)])
def test_sampled_logprobs_match_float64_forward(scale: float, softcap: float | None) -> None:
    model = tiny_model()
    tokenizer = ByteTokenizer()
    prompts = [tokenizer.encode(text, bos=True) for text in ("1+2=", "7+8=", "ab>", "3+3=")]
    options = SamplingOptions(max_new_tokens=6, stop_token=EOS, pad_token=PAD, logit_scale=scale, softcap=softcap)
    completions = sample_completions(model, prompts, options, torch.Generator().manual_seed(0))
    assert model.training  # mode restored
    worst = 0.0
    for prompt, completion in zip(prompts, completions):
        assert 1 <= len(completion.tokens) <= 6 and len(completion.logprobs) == len(completion.tokens)
        assert completion.stopped == (completion.tokens[-1] == EOS) and EOS not in completion.tokens[:-1]
        want = reference_logprobs(model, prompt + completion.tokens, len(prompt), scale, softcap)
        worst = max(worst, rel_err(torch.tensor(completion.logprobs), want))
    print(f"sampler log-probs (scale {scale}, softcap {softcap}) vs float64 forward: max rel err {worst:.2e}")
    assert worst < 1e-4


def test_sampling_is_seeded_and_stops() -> None:
    model = tiny_model()
    prompts = [[BOS, 50, 43, 50, 61]] * 8
    options = SamplingOptions(max_new_tokens=5, stop_token=EOS, pad_token=PAD, temperature=1.0)
    first = sample_completions(model, prompts, options, torch.Generator().manual_seed(11))
    again = sample_completions(model, prompts, options, torch.Generator().manual_seed(11))
    other = sample_completions(model, prompts, options, torch.Generator().manual_seed(12))
    assert [c.tokens for c in first] == [c.tokens for c in again]
    assert [c.tokens for c in first] != [c.tokens for c in other]
    # greedy picks the argmax; with that token as the stop token every completion ends right there
    with torch.no_grad():
        expected = int(model.logits(torch.tensor([prompts[0]]))[0, -1].argmax())
    greedy = sample_completions(model, prompts, SamplingOptions(5, stop_token=expected, pad_token=PAD, temperature=0.0), torch.Generator())
    assert all(c.tokens == [expected] and c.stopped and c.logprobs == [0.0] for c in greedy)


def test_bad_requests_are_named() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match="exceeds model.max_seq_len 48"):
        sample_completions(model, [[BOS] * 45], SamplingOptions(max_new_tokens=4, stop_token=EOS, pad_token=PAD), torch.Generator())
    with pytest.raises(ValueError, match="every prompt needs a token"):
        sample_completions(model, [[]], SamplingOptions(max_new_tokens=4, stop_token=EOS, pad_token=PAD), torch.Generator())
