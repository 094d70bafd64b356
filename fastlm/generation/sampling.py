"""Next-token sampling on the device: the head's logit transform, temperature, top-k, top-p, a seeded draw.

Everything stays on the device (no host round trip per token). A draw is the exponential race
argmax(p / E), E ~ Exp(1) i.i.d. from a seeded `torch.Generator` on the model's device: it picks token i
with probability p_i (the Gumbel-max trick), so a seed gives the same completions on a given device. The
noise is drawn separately (`draw_race`) so the pick itself has no generator argument: it runs inside a
compiled, CUDA-graph-captured decode step, with the noise buffer refilled before each replay. No sort
runs unless top_p < 1 (top-k is one `topk`).
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


def draw_race(race: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Fill `race` (B, V) float32 with the Exp(1) noise of one draw, in place."""
    return race.exponential_(generator=generator)


def pick_tokens(
    logits: torch.Tensor, options: SamplingOptions, race: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, V) raw logits -> (chosen ids (B,), their log-probs (B,) under the sampling distribution).

    `race` is the (B, V) noise from `draw_race` (ignored, and may be None, when greedy)."""
    logp = next_token_logprobs(logits, options)
    if options.greedy:
        choice = logp.argmax(dim=-1)
    else:
        assert race is not None, "sampling needs the noise of draw_race"
        choice = (logp - race.clamp_min(1e-30).log()).argmax(dim=-1)  # clamped: log(0) would give NaN
    return choice, logp.gather(-1, choice[:, None]).squeeze(-1)
