"""Cross entropy: `lse - x_y` per token; gradient `w/N * (p_j - [j == y])`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from fastlm.losses.children.base import ChildConfig, KernelSlot, LossChild, ReferenceInputs, Tail, TailInputs
from fastlm.losses.tensors import safe_inverse


class CrossEntropyConfig(ChildConfig):
    type: Literal["cross_entropy"] = "cross_entropy"

    def to_child(self, name: str) -> CrossEntropy:
        return CrossEntropy(name, self.weight)


@dataclass(frozen=True)
class CrossEntropy(LossChild):
    kind = "cross_entropy"

    def tail(self, inputs: TailInputs, out: Tail) -> None:
        out.loss(self.name, -inputs.new_logp, inputs.per_token)
        if self.weight != 0:
            out.add_label_form(inputs.mask.to(inputs.dtype) * (self.weight * inputs.per_token))

    def reference(self, inputs: ReferenceInputs) -> torch.Tensor:
        total = F.cross_entropy(inputs.x, inputs.targets.labels, ignore_index=-100, reduction="sum")
        return total * safe_inverse(inputs.normalizers.tokens)

    def slot(self) -> KernelSlot:
        return KernelSlot(self.kind, ("loss",), {"weight": self.weight})
