"""Diagnostics of the monolithic loss, in one place, named like TRL's dashboard.

Every value is additive: a sum over this call's unmasked tokens (or documents) divided by the
step-wide count, so the trainer sums micro-batches and all-reduces ranks to get the step mean.
Metrics are computed for every present child, including children of weight 0.

The per-token vectors handed in are already 0 on masked tokens (`coefficients.label_children`
masks lse, new_logp, entropy, old_logp and advantages once), so no function here indexes with a
boolean mask (a device->host sync) or re-masks. The sums are deferred into `Sums`, which reduces all
vectors of one length and scale with a single stack + sum: the loss tail is dozens of tiny
reductions, and on a GPU each one is a kernel launch.

KL to the sampling policy uses Schulman's k3 estimator with d = old_logp - new_logp:
`kl = exp(d) - d - 1` (>= 0, the formula TRL uses), an estimate of KL(pi_new || pi_old).
"""

from __future__ import annotations

import torch

from fastlm.losses.seam import GSPOSeam, safe_inverse
from fastlm.losses.spec import ClippedPolicySpec, LossNormalizers


class Sums:
    """Deferred `values.sum() * scale` entries, reduced together by (length, scale) in `resolve`."""

    def __init__(self) -> None:
        self._groups: dict[tuple[int, float], list[tuple[dict[str, torch.Tensor], str, torch.Tensor]]] = {}

    def add(self, into: dict[str, torch.Tensor], key: str, values: torch.Tensor, scale: float) -> None:
        """Schedule `into[key] = values.sum() * scale` (values: a 1-d vector, bool allowed)."""
        self._groups.setdefault((values.shape[0], scale), []).append((into, key, values))

    def resolve(self) -> None:
        """One stack + sum + scale per group; fills every scheduled key with a 0-d tensor."""
        for (_, scale), entries in self._groups.items():
            dtype = max((v.dtype for _, _, v in entries if v.is_floating_point()), key=_float_rank, default=torch.float32)
            totals = torch.stack([values.to(dtype) for _, _, values in entries]).sum(dim=1) * scale
            for (into, key, _), total in zip(entries, totals.unbind()):
                into[key] = total
        self._groups.clear()


def _float_rank(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits


# Metric names (the part after "<child>/"), in one place: the torch tail below and the fused Triton
# kernel's per-token rows (coefficients.fused_layout, kernel.py, same order) both use these tuples.
Z_LOSS_METRICS = ("lse",)
TOKEN_POLICY_METRICS = ("new_logp", "entropy", "kl")  # token means, GRPO and GSPO
RATIO_METRICS = ("ratio", "advantage", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
GRPO_METRICS = TOKEN_POLICY_METRICS + RATIO_METRICS  # all token means


def metric_key(child: str, metric: str) -> str:
    return f"{child}/{metric}"


def _add_all(
    sums: Sums, into: dict[str, torch.Tensor], child: str, names: tuple[str, ...], values: tuple[torch.Tensor, ...],
    scale: float,
) -> None:
    for name, value in zip(names, values, strict=True):
        sums.add(into, metric_key(child, name), value, scale)


def k3_kl(new_logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate exp(old-new) - (old-new) - 1."""
    delta = old_logp - new_logp
    return torch.expm1(delta) - delta


def _ratio_values(
    ratio: torch.Tensor, advantage: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, ...]:
    """The RATIO_METRICS vectors. TRL's clip ratios: low = ratio below 1-eps_low with A<0, high =
    above 1+eps_high with A>0 (entries with A = 0, e.g. masked tokens, count in neither)."""
    low = (ratio < 1.0 - eps_low) & (advantage < 0)
    high = (ratio > 1.0 + eps_high) & (advantage > 0)
    return ratio, advantage, low, high, low | high


def grpo_metrics(
    sums: Sums, into: dict[str, torch.Tensor], spec: ClippedPolicySpec, new_logp: torch.Tensor,
    old_logp: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor, entropy: torch.Tensor,
    normalizers: LossNormalizers,
) -> None:
    """GRPO: everything is a token mean over the step's unmasked tokens (`ratio` is 0 on masked ones)."""
    values = (new_logp, entropy, k3_kl(new_logp, old_logp), *_ratio_values(ratio, advantages, spec.eps_low, spec.eps_high))
    _add_all(sums, into, spec.name, GRPO_METRICS, values, safe_inverse(normalizers.tokens))


def gspo_metrics(
    sums: Sums, into: dict[str, torch.Tensor], spec: ClippedPolicySpec, seam: GSPOSeam, new_logp: torch.Tensor,
    old_logp: torch.Tensor, entropy: torch.Tensor, normalizers: LossNormalizers,
) -> None:
    """GSPO: per-token new_logp/entropy/kl; ratio, advantage and clip ratios are document means."""
    token_values = (new_logp, entropy, k3_kl(new_logp, old_logp))
    _add_all(sums, into, spec.name, TOKEN_POLICY_METRICS, token_values, safe_inverse(normalizers.tokens))
    gspo_document_metrics(sums, into, spec, seam, normalizers)


def gspo_document_metrics(
    sums: Sums, into: dict[str, torch.Tensor], spec: ClippedPolicySpec, seam: GSPOSeam, normalizers: LossNormalizers
) -> None:
    """The document means of GSPO (and num_documents); the fused kernel writes the token means itself.
    Slots without a document hold zeros, so they add nothing."""
    document_values = _ratio_values(seam.ratio, seam.advantage, spec.eps_low, spec.eps_high)
    _add_all(sums, into, spec.name, RATIO_METRICS, document_values, safe_inverse(normalizers.documents))
    sums.add(into, metric_key(spec.name, "num_documents"), seam.present, 1.0)


def z_loss_metrics(sums: Sums, into: dict[str, torch.Tensor], name: str, lse: torch.Tensor, normalizers: LossNormalizers) -> None:
    """z-loss: the mean log-partition, the quantity it pushes towards 0."""
    _add_all(sums, into, name, Z_LOSS_METRICS, (lse,), safe_inverse(normalizers.tokens))
