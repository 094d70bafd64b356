"""Plain-number description of a monolithic loss.

Config objects stop here: `LossSpec.from_config` turns a validated `MonolithicLossConfig` into the
children's plain objects (`fastlm.losses.children`), shared by the compiled, Triton and reference
paths. Kernels and launchers take a `LossSpec` and tensors (fastlm/losses/tensors.py), never a config.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

# The tensor types, importable from here too (most callers outside fastlm/losses do)
from fastlm.losses.tensors import (
    IGNORE_INDEX,
    LossNormalizers,
    LossResult,
    LossTargets,
    ProcessGroup,
    TeacherHead,
    label_logp,
    pick_labels,
    safe_inverse,
    transform_logits,
)

if TYPE_CHECKING:
    from fastlm.losses.children.base import LossChild
    from fastlm.losses.config import MonolithicLossConfig

__all__ = [
    "IGNORE_INDEX",
    "LossNormalizers",
    "LossResult",
    "LossSpec",
    "LossTargets",
    "ProcessGroup",
    "TeacherHead",
    "assemble_result",
    "label_logp",
    "pick_labels",
    "safe_inverse",
    "transform_logits",
]


@dataclass(frozen=True)
class LossSpec:
    """The children sharing one softmax (in config order, at most one of each kind), with the head's numbers."""

    children: tuple[LossChild, ...] = ()
    logit_scale: float = 1.0
    softcap: float | None = None
    chunk_tokens: int = 4096

    @classmethod
    def from_config(cls, config: MonolithicLossConfig) -> LossSpec:
        children = tuple(child.to_child(name) for name, child in config.children.items())
        return cls(children, logit_scale=config.logit_scale, softcap=config.softcap, chunk_tokens=config.chunk_tokens)

    def reads(self, target: str) -> bool:
        """Whether some child reads this `LossTargets` field (besides the labels every child reads)."""
        return target in self._read_targets

    @cached_property
    def _read_targets(self) -> frozenset[str]:
        return frozenset(name for child in self.children for name in child.reads)

    @cached_property
    def teacher(self) -> LossChild | None:
        """The child that reads teacher logits (at most one: validation keeps one child per kind)."""
        return next((child for child in self.children if child.uses_teacher), None)

    @cached_property
    def per_document(self) -> tuple[LossChild, ...]:
        """Children whose coefficients need every token's log-prob first (the seam between two launches)."""
        return tuple(child for child in self.children if child.per_document)

    @cached_property
    def whole_call(self) -> bool:
        """Whether a child needs every token's statistics of the call before its coefficients."""
        return any(child.whole_call for child in self.children)


def assemble_result(
    spec: LossSpec,
    losses: dict[str, torch.Tensor],
    metrics: dict[str, torch.Tensor],
    kernel_total: torch.Tensor | None = None,
) -> LossResult:
    """The one result assembly of every path: losses in child order and the weighted total. The fused
    kernel sums its own children's total (`kernel_total`); the per-document children are added here."""
    ordered = {child.name: losses[child.name] for child in spec.children}
    if kernel_total is None:
        added, total = spec.children, torch.zeros((), dtype=torch.float32)
    else:
        added, total = spec.per_document, kernel_total
    for child in added:
        total = total + child.weight * ordered[child.name]
    return LossResult(total, ordered, metrics)
