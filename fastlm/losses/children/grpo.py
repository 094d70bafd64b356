"""GRPO (PPO's clipped surrogate per token): `-min(r A, clip(r, 1-eps_low, 1+eps_high) A)`, r = exp(new - old).

Gradient `c*(p_j - [j == y])` with `c = w*r*(max(A,0)*[r <= 1+eps_high] + min(A,0)*[r >= 1-eps_low]*[r <= delta])`:
the unclipped term carries the gradient where it is the active min. `delta` (TRL's two-sided GRPO;
dual-clip PPO for A < 0) caps r in the unclipped term, so a negative-advantage token's loss is at most
`-delta*A` and carries no gradient past it; it must exceed 1 + eps_high, where it then changes nothing
for A > 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field, model_validator

from fastlm.losses.children.base import KernelSlot, ReferenceInputs, Tail, TailInputs
from fastlm.losses.children.policy import PolicyChild, PolicyConfig, dual_clip
from fastlm.losses.metrics import clip_fractions

RATIO_METRICS = ("ratio", "advantage", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


class ClippedPolicyConfig(PolicyConfig):
    eps_low: float = Field(0.2, gt=0.0, lt=1.0, description="Clip the ratio from below at 1 - eps_low.")
    eps_high: float = Field(0.2, gt=0.0, description="Clip the ratio from above at 1 + eps_high.")
    delta: float | None = Field(
        None, description="Dual clip: cap the unclipped ratio at delta (> 1 + eps_high); None = off."
    )

    @model_validator(mode="after")
    def _check_delta(self) -> ClippedPolicyConfig:
        if self.delta is not None and not self.delta > 1.0 + self.eps_high:
            raise ValueError(
                f"delta must be > 1 + eps_high = {1.0 + self.eps_high:g} (it bounds the ratio above the clip), got {self.delta}"
            )
        return self


class GRPOConfig(ClippedPolicyConfig):
    type: Literal["grpo"] = "grpo"

    def to_child(self, name: str) -> GRPO:
        return GRPO(name, self.weight, **self.policy_numbers(), eps_low=self.eps_low, eps_high=self.eps_high,
                    delta=dual_clip(self.delta))


def clipped_surrogate(
    ratio: torch.Tensor, advantage: torch.Tensor, eps_low: float, eps_high: float, delta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss -min(min(r, delta) A, clip(r) A), slope r*A where the unclipped term is active, else 0)."""
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    dual = delta != float("inf")
    capped = ratio.clamp(max=delta) if dual else ratio
    loss = -torch.minimum(capped * advantage, clipped * advantage)
    lower = (ratio >= 1.0 - eps_low) & (ratio <= delta) if dual else ratio >= 1.0 - eps_low
    active = torch.where(advantage >= 0, ratio <= 1.0 + eps_high, lower)
    return loss, ratio * advantage * active


@dataclass(frozen=True)
class GRPO(PolicyChild):
    eps_low: float = 0.2
    eps_high: float = 0.2
    delta: float = float("inf")

    kind = "grpo"

    def metric_names(self) -> tuple[str, ...]:
        return self.token_metric_names() + RATIO_METRICS

    def tail(self, inputs: TailInputs, out: Tail) -> None:
        mask, advantage = inputs.mask, inputs.target("advantages")
        ratio = torch.exp(inputs.new_logp - inputs.target("old_logp"))  # 1 on masked tokens (both 0)
        token_loss, slope = clipped_surrogate(ratio, advantage, self.eps_low, self.eps_high, self.delta)
        self.token_level_loss(inputs, out, token_loss, slope)
        low, high, region = clip_fractions(ratio, advantage, 1.0 - self.eps_low, 1.0 + self.eps_high)
        for metric, value in zip(RATIO_METRICS, (ratio * mask, advantage, low, high, region), strict=True):
            out.metric(self.name, metric, value, inputs.per_token)

    def reference(self, inputs: ReferenceInputs) -> torch.Tensor:
        mask = inputs.mask
        old = torch.where(mask, inputs.targets.old_logp.to(inputs.new_logp.dtype), 0.0)
        advantage = torch.where(mask, inputs.targets.advantages.to(inputs.new_logp.dtype), 0.0)
        ratio = torch.exp(inputs.new_logp - old)
        clipped = ratio.clamp(1.0 - self.eps_low, 1.0 + self.eps_high)
        capped = torch.minimum(ratio, torch.full_like(ratio, self.delta))
        weights, selected = self.reference_weights(inputs), self.reference_selected(inputs)
        token_loss = -torch.min(capped * advantage, clipped * advantage) * selected
        return (token_loss * weights).sum() + self.reference_regularizers(inputs, weights, selected)

    def slot(self) -> KernelSlot | None:
        return self.token_level_slot({"eps_low": self.eps_low, "eps_high": self.eps_high,
                                      "delta": min(self.delta, 3.0e38)})



