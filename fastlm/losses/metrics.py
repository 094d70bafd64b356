"""Diagnostics of the monolithic loss, in one place, named like TRL's dashboard.

Every value is additive: a sum over this call's unmasked tokens (or documents) divided by the
step-wide count, so the trainer sums micro-batches and all-reduces ranks to get the step mean.
Metrics are computed for every present child, including children of weight 0.

KL to the sampling policy uses Schulman's k3 estimator with d = old_logp - new_logp:
`kl = exp(d) - d - 1` (>= 0, the formula TRL uses), an estimate of KL(pi_new || pi_old).
"""

from __future__ import annotations

import torch

from fastlm.losses.seam import GSPOSeam, safe_inverse
from fastlm.losses.spec import ClippedPolicySpec, LossNormalizers


def k3_kl(new_logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate exp(old-new) - (old-new) - 1."""
    delta = old_logp - new_logp
    return torch.expm1(delta) - delta


def clip_fractions(
    prefix: str, ratio: torch.Tensor, advantage: torch.Tensor, eps_low: float, eps_high: float, scale: float
) -> dict[str, torch.Tensor]:
    """TRL's clip ratios: low = ratio below 1-eps_low with A<0, high = above 1+eps_high with A>0."""
    low = (ratio < 1.0 - eps_low) & (advantage < 0)
    high = (ratio > 1.0 + eps_high) & (advantage > 0)
    return {
        f"{prefix}/clip_ratio/low_mean": low.sum().to(ratio.dtype) * scale,
        f"{prefix}/clip_ratio/high_mean": high.sum().to(ratio.dtype) * scale,
        f"{prefix}/clip_ratio/region_mean": (low | high).sum().to(ratio.dtype) * scale,
    }


def _token_mean(values: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.where(mask, values, torch.zeros_like(values)).sum() * scale


def token_policy_metrics(
    name: str,
    new_logp: torch.Tensor,
    old_logp: torch.Tensor,
    entropy: torch.Tensor,
    mask: torch.Tensor,
    normalizers: LossNormalizers,
) -> dict[str, torch.Tensor]:
    """Per-token diagnostics shared by GRPO and GSPO: new_logp, entropy and kl, token means."""
    scale = safe_inverse(normalizers.tokens)
    return {
        f"{name}/new_logp": _token_mean(new_logp, mask, scale),
        f"{name}/entropy": _token_mean(entropy, mask, scale),
        f"{name}/kl": _token_mean(k3_kl(new_logp, old_logp), mask, scale),
    }


def grpo_metrics(
    spec: ClippedPolicySpec,
    new_logp: torch.Tensor,
    old_logp: torch.Tensor,
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    entropy: torch.Tensor,
    mask: torch.Tensor,
    normalizers: LossNormalizers,
) -> dict[str, torch.Tensor]:
    """GRPO: everything is a token mean over the step's unmasked tokens."""
    scale = safe_inverse(normalizers.tokens)
    return {
        **token_policy_metrics(spec.name, new_logp, old_logp, entropy, mask, normalizers),
        f"{spec.name}/ratio": _token_mean(ratio, mask, scale),
        f"{spec.name}/advantage": _token_mean(advantages, mask, scale),
        **clip_fractions(spec.name, ratio[mask], advantages[mask], spec.eps_low, spec.eps_high, scale),
    }


def gspo_metrics(
    spec: ClippedPolicySpec,
    seam: GSPOSeam,
    new_logp: torch.Tensor,
    old_logp: torch.Tensor,
    entropy: torch.Tensor,
    mask: torch.Tensor,
    normalizers: LossNormalizers,
) -> dict[str, torch.Tensor]:
    """GSPO: per-token new_logp/entropy/kl; ratio, advantage and clip ratios are document means."""
    scale = safe_inverse(normalizers.documents)
    return {
        **token_policy_metrics(spec.name, new_logp, old_logp, entropy, mask, normalizers),
        f"{spec.name}/ratio": seam.ratio.sum() * scale,
        f"{spec.name}/advantage": seam.advantage.sum() * scale,
        f"{spec.name}/num_documents": seam.ratio.new_tensor(float(seam.ratio.numel())),
        **clip_fractions(spec.name, seam.ratio, seam.advantage, spec.eps_low, spec.eps_high, scale),
    }


def z_loss_metrics(name: str, lse: torch.Tensor, mask: torch.Tensor, normalizers: LossNormalizers) -> dict[str, torch.Tensor]:
    """z-loss: the mean log-partition, the quantity it pushes towards 0."""
    return {f"{name}/lse": _token_mean(lse, mask, safe_inverse(normalizers.tokens))}
