"""Next-token sampling on the device: the head's logit transform, temperature, top-k, top-p, a seeded draw.

Everything stays on the device (no host round trip per token). A draw is an inverse-CDF pick: the first
token whose cumulative probability passes u, with u in [0, 1) a counter-based hash of the sequence's seed
and the draw's index in its completion (`draw_uniforms`). Each sequence gets its own seed, drawn once per
request from the caller's `torch.Generator` (`sequence_seeds`), so its tokens do not depend on which
batch row or decode slot it lands in, or on when it is decoded: the static generator and the continuous-
batching engine (engine.py) draw the same tokens for the same (prompt, sample) pairs, and a sequence that
waits or is recomputed draws what it would have drawn. The draw needs no generator state and no host
round trip, so it runs inside a compiled, CUDA-graph-captured decode step. No sort runs unless top_p < 1
(top-k is one `topk`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fastlm.losses.spec import transform_logits


@dataclass(frozen=True)
class SamplingOptions:
    """What to sample. temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off; an empty
    `stop_tokens` samples the whole budget. logit_scale/softcap are the head's transform (the loss's softmax)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_tokens: tuple[int, ...] = ()
    logit_scale: float = 1.0
    softcap: float | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature < math.inf or not 0 < self.top_p <= 1 or self.top_k < 0:  # NaN fails both
            raise ValueError(
                f"need a finite temperature >= 0, top_p in (0, 1] and top_k >= 0; got {self.temperature}, {self.top_p}, "
                f"{self.top_k}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def next_token_logprobs(logits: torch.Tensor, options: SamplingOptions) -> torch.Tensor:
    """(B, V) raw logits -> (B, V) float32 log-probs of the sampling distribution (-inf outside top-k/top-p).

    Greedy (temperature 0) gives the untempered softmax. Top-p keeps the smallest set of most likely tokens
    whose mass reaches top_p (always at least one), after top-k.
    """
    scaled = transform_logits(logits.float(), options.logit_scale, options.softcap)
    if not options.greedy and options.temperature != 1.0:
        scaled = scaled / options.temperature
    if not options.greedy and 0 < options.top_k < scaled.shape[-1]:
        kth = scaled.topk(options.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    logp = torch.log_softmax(scaled, dim=-1)
    if options.greedy or options.top_p >= 1.0:
        return logp
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    sorted_probs = sorted_logp.exp()
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    dropped = torch.zeros_like(logp, dtype=torch.bool).scatter(-1, order, mass_before >= options.top_p)
    kept = logp.masked_fill(dropped, float("-inf"))
    return kept - kept.logsumexp(dim=-1, keepdim=True)


def next_token_distribution(logits: torch.Tensor, options: SamplingOptions) -> torch.Tensor:
    """(B, V) probabilities of the sampling distribution (see `next_token_logprobs`)."""
    return next_token_logprobs(logits, options).exp()


SEED_LIMIT = 2**62  # sequence seeds are drawn in [0, SEED_LIMIT)
_LOW32 = 0xFFFFFFFF


def sequence_seeds(count: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """(count,) int64 seeds, one per sequence of a request, from `generator` (None: torch's default
    generator on `device`): the only state a sequence's draws depend on."""
    where = generator.device if generator is not None else device
    return torch.randint(0, SEED_LIMIT, (count,), generator=generator, device=where).to(device)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 values in [0, 2^32); products split in 16-bit halves so no
    intermediate leaves the int64 range (no reliance on wrap-around)."""

    def times(value: torch.Tensor, factor: int) -> torch.Tensor:
        high = ((value >> 16) * factor) & 0xFFFF
        return ((high << 16) + (value & 0xFFFF) * factor) & _LOW32

    x = x ^ (x >> 16)
    x = times(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = times(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def draw_uniforms(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """(B,) float32 uniforms in [0, 1 - 2^-24], a hash of each sequence's seed (B,) and draw index (B,) or ()."""
    mixed = _mix32((steps & _LOW32) ^ 0x9E3779B9)
    mixed = _mix32(mixed ^ (seeds & _LOW32))
    mixed = _mix32(mixed ^ ((seeds >> 32) & _LOW32))
    return (mixed >> 8).to(torch.float32) * 2.0**-24


def pick_tokens(
    logits: torch.Tensor, options: SamplingOptions, uniforms: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, V) raw logits -> (chosen ids (B,), their log-probs (B,) under the sampling distribution).

    `uniforms` (B,) from `draw_uniforms` (ignored, and may be None, when greedy): the first token whose
    cumulative probability exceeds u times the total (a token of probability 0 is never picked)."""
    logp = next_token_logprobs(logits, options)
    if options.greedy:
        choice = logp.argmax(dim=-1)
    else:
        assert uniforms is not None, "sampling needs the uniforms of draw_uniforms"
        cumulative = logp.exp().cumsum(dim=-1)
        target = uniforms[:, None] * cumulative[:, -1:]
        choice = (cumulative <= target).sum(dim=-1).clamp_max(logp.shape[-1] - 1)
        picked = logp.gather(-1, choice[:, None]).squeeze(-1)
        choice = torch.where(picked == float("-inf"), logp.argmax(dim=-1), choice)  # u rounded onto the total
    return choice, logp.gather(-1, choice[:, None]).squeeze(-1)
