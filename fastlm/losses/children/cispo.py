"""CISPO (MiniMax-M1; TRL's loss_type "cispo"): `-sg(min(r, eps_high)) * A * new_logp` per token.

`eps_high` is the cap itself, as TRL's `epsilon_high` (`torch.clamp(coef_1, max=epsilon_high)`; TRL
recommends 5.0; the paper's eps_high^IS bounds r at 1 + eps_high^IS, so its value there is one less).
The importance weight is clipped and detached, never the token: every token keeps a gradient,
`c = w*min(r, eps_high)*A` in `c*(p_j - [j == y])`. Metric `cispo_clip_ratio`: tokens with r above
the cap and A > 0 (TRL's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field

from fastlm.losses.children.base import KernelSlot, ReferenceInputs, Tail, TailInputs
from fastlm.losses.children.policy import PolicyChild, PolicyConfig

RATIO_METRICS = ("ratio", "advantage", "cispo_clip_ratio")


class CISPOConfig(PolicyConfig):
    type: Literal["cispo"] = "cispo"
    eps_high: float = Field(
        5.0, gt=0.0, description="Cap of the detached ratio, as TRL's epsilon_high (5.0 recommended): min(r, eps_high)."
    )

    def first_update_slope(self) -> float:
        """min(r, eps_high) at r = 1: a cap below 1 scales every token's slope."""
        return min(1.0, self.eps_high)

    def to_child(self, name: str) -> CISPO:
        return CISPO(name, self.weight, **self.policy_numbers(), eps_high=self.eps_high)


@dataclass(frozen=True)
class CISPO(PolicyChild):
    eps_high: float = 5.0

    kind = "cispo"

    def metric_names(self) -> tuple[str, ...]:
        return self.token_metric_names() + RATIO_METRICS

    def tail(self, inputs: TailInputs, out: Tail) -> None:
        advantage = inputs.target("advantages")
        ratio = torch.exp(inputs.new_logp - inputs.target("old_logp"))
        slope = ratio.clamp(max=self.eps_high) * advantage
        self.token_level_loss(inputs, out, -slope * inputs.new_logp, slope)
        clipped = (ratio > self.eps_high) & (advantage > 0)
        for metric, value in zip(RATIO_METRICS, (ratio * inputs.mask, advantage, clipped), strict=True):
            out.metric(self.name, metric, value, inputs.per_token)

    def reference(self, inputs: ReferenceInputs) -> torch.Tensor:
        mask = inputs.mask
        old = torch.where(mask, inputs.targets.old_logp.to(inputs.new_logp.dtype), 0.0)
        advantage = torch.where(mask, inputs.targets.advantages.to(inputs.new_logp.dtype), 0.0)
        weight = torch.clamp(torch.exp(inputs.new_logp - old), max=self.eps_high).detach()
        weights, selected = self.reference_weights(inputs), self.reference_selected(inputs)
        token_loss = -weight * advantage * inputs.new_logp * selected
        return (token_loss * weights).sum() + self.reference_regularizers(inputs, weights, selected)

    def slot(self) -> KernelSlot | None:
        return self.token_level_slot({"cap": self.eps_high})
