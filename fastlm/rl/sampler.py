"""Batched autoregressive sampling from the current policy: temperature, top-p, a token budget, a stop token.

No KV cache: each new token re-runs the forward over the whole (short) sequence; completions here are a
few tokens long, so this costs little and keeps the model code untouched. Prompts are right-padded;
with causal attention a row's next-token logits never see the padding after it. The logits go through
`transform_logits` (the head's logit_scale/softcap), so sampling sees the softmax the loss sees.
Random draws use a CPU `torch.Generator`, so a seed gives the same completions on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastlm.engine.runtime import autocast
from fastlm.losses.spec import transform_logits
from fastlm.models.decoder import DecoderLM


@dataclass(frozen=True)
class SamplingOptions:
    max_new_tokens: int
    stop_token: int  # the tokenizer's EOS
    pad_token: int  # fills positions after a row stopped (never read by a later token)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None


@dataclass(frozen=True)
class Completion:
    """Sampled tokens (the stop token included when it was drawn) and their log-probs under the sampling
    distribution (after temperature and top-p; 0 for greedy picks)."""

    tokens: list[int]
    logprobs: list[float]
    stopped: bool


def next_token_distribution(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """(B, V) transformed logits -> (B, V) float32 probabilities after temperature and top-p (nucleus).

    Top-p keeps the smallest set of most likely tokens whose mass reaches top_p (always at least one).
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = torch.where(mass_before < top_p, sorted_probs, torch.zeros_like(sorted_probs))
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


def _check(prompts: list[list[int]], options: SamplingOptions, model: DecoderLM) -> None:
    if not prompts or any(not prompt for prompt in prompts):
        raise ValueError("sample_completions needs at least one prompt, and every prompt needs a token (BOS)")
    longest = max(len(p) for p in prompts) + options.max_new_tokens
    if longest > model.config.max_seq_len:
        raise ValueError(
            f"prompt ({longest - options.max_new_tokens} tokens) + max_new_tokens ({options.max_new_tokens}) "
            f"exceeds model.max_seq_len {model.config.max_seq_len}"
        )
    if options.temperature < 0 or not 0 < options.top_p <= 1:
        raise ValueError(f"temperature must be >= 0 and top_p in (0, 1], got {options.temperature}, {options.top_p}")


@torch.no_grad()
def sample_completions(
    model: DecoderLM,
    prompts: list[list[int]],
    options: SamplingOptions,
    generator: torch.Generator,
    amp_dtype: torch.dtype | None = None,
) -> list[Completion]:
    """One completion per prompt (repeat a prompt G times for a group). The model is left in eval mode
    for the call and restored to its previous mode."""
    _check(prompts, options, model)
    device = model.output_weight.device
    was_training = model.training
    model.eval()
    lengths = torch.tensor([len(p) for p in prompts])
    width = int(lengths.max()) + options.max_new_tokens
    tokens = torch.full((len(prompts), width), options.pad_token, dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.tensor(prompt)
    rows = torch.arange(len(prompts))
    done = torch.zeros(len(prompts), dtype=torch.bool)
    drawn: list[torch.Tensor] = []
    logprobs: list[torch.Tensor] = []
    for step in range(options.max_new_tokens):
        positions = lengths + step - 1
        context = int(positions.max()) + 1
        with autocast(device, amp_dtype):
            raw = model.logits(tokens[:, :context].to(device))
        last = raw[rows.to(device), positions.to(device)].float().cpu()
        logits = transform_logits(last, options.logit_scale, options.softcap)
        if options.temperature == 0:
            choice = logits.argmax(dim=-1)
            logprob = torch.zeros(len(prompts))
        else:
            probs = next_token_distribution(logits, options.temperature, options.top_p)
            choice = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            logprob = probs.gather(1, choice[:, None]).squeeze(1).log()
        choice = torch.where(done, torch.full_like(choice, options.pad_token), choice)
        tokens[rows, positions + 1] = choice
        drawn.append(choice)
        logprobs.append(logprob)
        done |= choice == options.stop_token
        if bool(done.all()):
            break
    model.train(was_training)
    return _completions(torch.stack(drawn, 1), torch.stack(logprobs, 1), options.stop_token)


def _completions(drawn: torch.Tensor, logprobs: torch.Tensor, stop_token: int) -> list[Completion]:
    """Cut each row after its stop token (or at the budget)."""
    out = []
    for row_tokens, row_logprobs in zip(drawn.tolist(), logprobs.tolist()):
        end = row_tokens.index(stop_token) + 1 if stop_token in row_tokens else len(row_tokens)
        out.append(Completion(row_tokens[:end], row_logprobs[:end], stop_token in row_tokens))
    return out
