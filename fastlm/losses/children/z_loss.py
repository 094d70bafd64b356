"""z-loss: `lse^2` per token, pushing the log-partition towards 0; gradient `2 w/N lse p_j`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field

from fastlm.losses.children.base import ChildConfig, KernelSlot, LossChild, ReferenceInputs, Tail, TailInputs
from fastlm.losses.tensors import safe_inverse


class ZLossConfig(ChildConfig):
    type: Literal["z_loss"] = "z_loss"
    weight: float = Field(1e-4, ge=0.0)

    def to_child(self, name: str) -> ZLoss:
        return ZLoss(name, self.weight)


@dataclass(frozen=True)
class ZLoss(LossChild):
    kind = "z_loss"
    metrics = ("lse",)  # the mean log-partition, the quantity it pushes towards 0

    def tail(self, inputs: TailInputs, out: Tail) -> None:
        out.loss(self.name, inputs.lse.square(), inputs.per_token)
        out.metric(self.name, "lse", inputs.lse, inputs.per_token)
        if self.weight != 0:
            out.prob += inputs.lse * (2.0 * self.weight * inputs.per_token)

    def reference(self, inputs: ReferenceInputs) -> torch.Tensor:
        lse = torch.logsumexp(inputs.x, dim=-1)
        return (lse.square() * inputs.mask).sum() * safe_inverse(inputs.normalizers.tokens)

    def slot(self) -> KernelSlot:
        return KernelSlot(self.kind, ("loss", *self.metrics), {"weight": self.weight})
