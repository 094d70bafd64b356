"""Deferred metric and loss sums, and the estimators the policy children log (named like TRL's dashboard).

Every value is additive: a sum over this call's unmasked tokens (or documents) divided by the
step-wide count, so the trainer sums micro-batches and all-reduces ranks to get the step mean.
Metrics are computed for every present child, including children of weight 0.

The per-token vectors handed in are already 0 on masked tokens (`children.base.TailInputs` masks
them once), so nothing here indexes with a boolean mask (a device->host sync) or re-masks. The sums
are deferred into `Sums`, which reduces all vectors of one length and scale with a single stack +
sum: the loss tail is dozens of tiny reductions, and on a GPU each one is a kernel launch.
"""

from __future__ import annotations

import torch


class Sums:
    """Deferred `values.sum() * scale` entries, reduced together by (length, scale) in `resolve`."""

    def __init__(self) -> None:
        self._groups: dict[tuple[int, float], list[tuple[dict[str, torch.Tensor], str, torch.Tensor]]] = {}
        self._order: list[tuple[dict[str, torch.Tensor], str]] = []

    def add(self, into: dict[str, torch.Tensor], key: str, values: torch.Tensor, scale: float) -> None:
        """Schedule `into[key] = values.sum() * scale` (values: a 1-d vector, bool allowed)."""
        self._groups.setdefault((values.shape[0], scale), []).append((into, key, values))
        self._order.append((into, key))

    def resolve(self) -> None:
        """One stack + sum + scale per group; fills every scheduled key with a 0-d tensor, in the order
        they were added (the children's order, as the fused path's term rows)."""
        found: dict[tuple[int, str], torch.Tensor] = {}
        for (_, scale), entries in self._groups.items():
            dtype = max((v.dtype for _, _, v in entries if v.is_floating_point()), key=_float_rank, default=torch.float32)
            totals = torch.stack([values.to(dtype) for _, _, values in entries]).sum(dim=1) * scale
            for (into, key, _), total in zip(entries, totals.unbind()):
                found[id(into), key] = total
        for into, key in self._order:
            into[key] = found[id(into), key]
        self._groups.clear()
        self._order.clear()


def _float_rank(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits


def k3_kl(new_logp: torch.Tensor, other_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimate of KL(pi_new || pi_other) per token, with d = other - new:
    exp(d) - d - 1 (>= 0; the formula TRL logs as `kl` against its reference model)."""
    delta = other_logp - new_logp
    return torch.expm1(delta) - delta


def clip_fractions(
    ratio: torch.Tensor, advantage: torch.Tensor, low_bound: float, high_bound: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's clip ratios: low = ratio below `low_bound` with A<0, high = above `high_bound` with A>0
    (entries with A = 0, e.g. masked tokens, count in neither), region = either."""
    low = (ratio < low_bound) & (advantage < 0)
    high = (ratio > high_bound) & (advantage > 0)
    return low, high, low | high
