"""Per-token statistics -> the two gradient coefficients, each child's loss, and the metrics.

Every label-based child (CE, z-loss, GRPO, GSPO) has a gradient of the form
`grad_tj = prob_coeff_t * p_tj - label_coeff_t * [j == y_t]` with respect to the transformed logits
x; this module sums the children's contributions (weight, normaliser and grad scale included) so the
gradient-writing pass (compiled or Triton) is loss-agnostic. Masked tokens get 0; weight-0 children
add their loss and metrics but nothing to the coefficients.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fastlm.losses.metrics import grpo_metrics, gspo_metrics, z_loss_metrics
from fastlm.losses.seam import gspo_seam, safe_inverse
from fastlm.losses.spec import ClippedPolicySpec, LossNormalizers, LossSpec, LossTargets


@dataclass
class TokenStats:
    """Global (all-reduced under tensor parallelism) per-token statistics of the transformed logits."""

    lse: torch.Tensor  # (T,) log sum_j exp(x_tj)
    new_logp: torch.Tensor  # (T,) x_{t,y} - lse_t (any value on masked tokens)
    entropy: torch.Tensor  # (T,) lse_t - sum_j p_tj x_tj
    mask: torch.Tensor  # (T,) bool, True where the label is not the ignore index


@dataclass
class LabelChildren:
    """What the gradient pass needs, plus the detached forward scalars and diagnostics."""

    prob_coeff: torch.Tensor  # (T,)
    label_coeff: torch.Tensor  # (T,)
    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def grpo_terms(
    new_logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, spec: ClippedPolicySpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ratio r, per-token loss -min(rA, clip(r)A), slope c) with
    c = r*(max(A,0)*[r <= 1+eps_high] + min(A,0)*[r >= 1-eps_low]); all 0 on masked tokens."""
    delta = torch.where(mask, new_logp - old_logp, torch.zeros_like(new_logp))
    ratio = torch.exp(delta)
    advantage = torch.where(mask, advantages, torch.zeros_like(advantages))
    clipped = ratio.clamp(1.0 - spec.eps_low, 1.0 + spec.eps_high)
    token_loss = -torch.minimum(ratio * advantage, clipped * advantage)
    slope = ratio * (
        advantage.clamp(min=0) * (ratio <= 1.0 + spec.eps_high) + advantage.clamp(max=0) * (ratio >= 1.0 - spec.eps_low)
    )
    zero = torch.zeros_like(ratio)
    return torch.where(mask, ratio, zero), torch.where(mask, token_loss, zero), torch.where(mask, slope, zero)


def label_children(
    stats: TokenStats,
    targets: LossTargets,
    normalizers: LossNormalizers,
    spec: LossSpec,
    grad_scale: float = 1.0,
) -> LabelChildren:
    """Sum the label-based children's coefficients; compute their losses and metrics (distillation excluded)."""
    mask = stats.mask
    dtype = torch.promote_types(stats.lse.dtype, torch.float32)
    lse = torch.where(mask, stats.lse.to(dtype), torch.zeros((), dtype=dtype, device=mask.device))
    new_logp = torch.where(mask, stats.new_logp.to(dtype), torch.zeros((), dtype=dtype, device=mask.device))
    entropy = stats.entropy.to(dtype)
    per_token = safe_inverse(normalizers.tokens)
    prob = torch.zeros_like(lse)
    label = torch.zeros_like(lse)
    out = LabelChildren(prob, label)
    if spec.cross_entropy is not None:
        child = spec.cross_entropy
        out.losses[child.name] = -new_logp.sum() * per_token
        if child.weight != 0:
            weight = mask.to(dtype) * (child.weight * per_token)
            prob += weight
            label += weight
    if spec.z_loss is not None:
        child = spec.z_loss
        out.losses[child.name] = lse.square().sum() * per_token
        out.metrics.update(z_loss_metrics(child.name, lse, mask, normalizers))
        if child.weight != 0:
            prob += lse * (2.0 * child.weight * per_token)
    if spec.needs_policy_inputs:
        old_logp = targets.old_logp.to(dtype)
        advantages = targets.advantages.to(dtype)
    if spec.grpo is not None:
        child = spec.grpo
        ratio, token_loss, slope = grpo_terms(new_logp, old_logp, advantages, mask, child)
        out.losses[child.name] = token_loss.sum() * per_token
        out.metrics.update(grpo_metrics(child, new_logp, old_logp, ratio, advantages, entropy, mask, normalizers))
        if child.weight != 0:
            coefficient = slope * (child.weight * per_token)
            prob += coefficient
            label += coefficient
    if spec.gspo is not None:
        child = spec.gspo
        seam = gspo_seam(new_logp, old_logp, advantages, targets.document_ids, mask, child, normalizers)
        out.losses[child.name] = seam.loss
        out.metrics.update(gspo_metrics(child, seam, new_logp, old_logp, entropy, mask, normalizers))
        prob += seam.coefficient
        label += seam.coefficient
    if grad_scale != 1.0:
        prob *= grad_scale
        label *= grad_scale
    return out
