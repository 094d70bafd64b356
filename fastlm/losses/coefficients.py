"""Per-token statistics -> the two gradient coefficients, each child's loss, and the metrics.

Every label-based child (CE, z-loss, GRPO, GSPO) has a gradient of the form
`grad_tj = prob_coeff_t * p_tj - label_coeff_t * [j == y_t]` with respect to the transformed logits
x; this module sums the children's contributions (weight, normaliser and grad scale included) so the
gradient-writing pass (compiled or Triton) is loss-agnostic. Masked tokens get 0; weight-0 children
add their loss and metrics but nothing to the coefficients.

This is the per-token tail after the vocab pass, so it is written for few device ops and no
device->host sync (the GSPO seam included): every input is masked once up front, and the
token sums of all losses and metrics are reduced together (`metrics.Sums`). The fused Triton kernel
skips it: it writes the same per-token terms into one buffer laid out by `fused_layout`, and
`fused_result` turns its token sums (one reduction launch) into the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fastlm.losses.metrics import (
    GRPO_METRICS,
    TOKEN_POLICY_METRICS,
    Z_LOSS_METRICS,
    Sums,
    grpo_metrics,
    gspo_metrics,
    metric_key,
    z_loss_metrics,
)
from fastlm.losses.seam import gspo_seam, safe_inverse
from fastlm.losses.spec import (
    ClippedPolicySpec,
    DistillationSpec,
    LossNormalizers,
    LossResult,
    LossSpec,
    LossTargets,
    WeightedSpec,
)
from fastlm.losses.validation import value_flag_count


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
    c = r*(max(A,0)*[r <= 1+eps_high] + min(A,0)*[r >= 1-eps_low]).
    Inputs are 0 on masked tokens, so r = 1 there and A = 0 zeroes the loss and the slope; only the
    ratio is masked (to 0) here."""
    ratio = torch.exp(new_logp - old_logp)
    clipped = ratio.clamp(1.0 - spec.eps_low, 1.0 + spec.eps_high)
    token_loss = -torch.minimum(ratio * advantages, clipped * advantages)
    slope = ratio * (
        advantages.clamp(min=0) * (ratio <= 1.0 + spec.eps_high) + advantages.clamp(max=0) * (ratio >= 1.0 - spec.eps_low)
    )
    return ratio * mask, token_loss, slope


def _masked(values: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`values` in `dtype`, 0 on masked tokens (whatever was there, NaN included); a Python 0 is no
    extra device tensor (a fill launch on CUDA)."""
    return torch.where(mask, values.to(dtype), 0.0)


def label_children(
    stats: TokenStats,
    targets: LossTargets,
    normalizers: LossNormalizers,
    spec: LossSpec,
    grad_scale: float = 1.0,
) -> LabelChildren:
    """Sum the label-based children's coefficients; compute their losses and metrics (distillation
    excluded)."""
    mask = stats.mask
    dtype = torch.promote_types(stats.lse.dtype, torch.float32)
    lse, new_logp = _masked(stats.lse, mask, dtype), _masked(stats.new_logp, mask, dtype)
    per_token = safe_inverse(normalizers.tokens)
    prob, label = torch.zeros_like(lse), torch.zeros_like(lse)
    out = LabelChildren(prob, label)
    sums = Sums()
    if spec.cross_entropy is not None:
        child = spec.cross_entropy
        sums.add(out.losses, child.name, -new_logp, per_token)
        if child.weight != 0:
            weight = mask.to(dtype) * (child.weight * per_token)
            prob += weight
            label += weight
    if spec.z_loss is not None:
        child = spec.z_loss
        sums.add(out.losses, child.name, lse.square(), per_token)
        z_loss_metrics(sums, out.metrics, child.name, lse, normalizers)
        if child.weight != 0:
            prob += lse * (2.0 * child.weight * per_token)
    if spec.needs_policy_inputs:
        entropy = _masked(stats.entropy, mask, dtype)
        old_logp = _masked(targets.old_logp, mask, dtype)
        advantages = _masked(targets.advantages, mask, dtype)
    if spec.grpo is not None:
        child = spec.grpo
        ratio, token_loss, slope = grpo_terms(new_logp, old_logp, advantages, mask, child)
        sums.add(out.losses, child.name, token_loss, per_token)
        grpo_metrics(sums, out.metrics, child, new_logp, old_logp, ratio, advantages, entropy, normalizers)
        if child.weight != 0:
            coefficient = slope * (child.weight * per_token)
            prob += coefficient
            label += coefficient
    if spec.gspo is not None:
        child = spec.gspo
        seam = gspo_seam(new_logp, old_logp, advantages, targets.document_ids, mask, child, normalizers)
        out.losses[child.name] = seam.loss
        gspo_metrics(sums, out.metrics, child, seam, new_logp, old_logp, entropy, normalizers)
        prob += seam.coefficient
        label += seam.coefficient
    sums.resolve()
    label_based = (spec.cross_entropy, spec.z_loss, spec.grpo, spec.gspo)
    out.losses = {child.name: out.losses[child.name] for child in label_based if child is not None}
    if grad_scale != 1.0:
        prob *= grad_scale
        label *= grad_scale
    return out


STATE_ROWS = ("lse", "new_logp", "prob_coeff", "label_coeff", "old_logp", "advantages", "teacher_lse")  # the last with distillation only


@dataclass(frozen=True)
class FusedLayout:
    """Rows of the fused kernel's (K, T) per-token buffer. Each present child has a group starting at
    its row (-1 when absent): its loss, then its metrics in `metrics` order (z: Z_LOSS_METRICS, grpo:
    GRPO_METRICS; gspo: TOKEN_POLICY_METRICS only, its loss and document metrics come from the seam);
    then the weighted total of the kernel's children; all of these already divided by the step's
    token count. Rows from `flags` to `summed` are the unscaled value-check counts
    (validation.value_flags order). With GSPO, rows from `state` on are what the seam and the gradient
    launch read per token, unscaled (STATE_ROWS order; 0 on masked tokens)."""

    ce: int
    z: int
    grpo: int
    gspo: int
    kd: int
    total: int
    flags: int
    summed: int
    state: int
    rows: int
    keys: tuple[tuple[bool, str], ...]  # (is a loss, result key) of each row before `total`

    def state_row(self, terms: torch.Tensor, name: str) -> torch.Tensor:
        """One per-token state vector (a contiguous view of `terms`)."""
        return terms[self.state + STATE_ROWS.index(name)]


def fused_layout(spec: LossSpec) -> FusedLayout:
    """The row table shared by the launcher (kernel constexprs) and `fused_result` (result keys)."""
    keys: list[tuple[bool, str]] = []

    def group(
        child: WeightedSpec | ClippedPolicySpec | DistillationSpec | None, metrics: tuple[str, ...], loss: bool = True
    ) -> int:
        if child is None:
            return -1
        if loss:
            keys.append((True, child.name))
        keys.extend((False, metric_key(child.name, name)) for name in metrics)
        return len(keys) - len(metrics) - loss

    rows = (
        group(spec.cross_entropy, ()),
        group(spec.z_loss, Z_LOSS_METRICS),
        group(spec.grpo, GRPO_METRICS),
        group(spec.gspo, TOKEN_POLICY_METRICS, loss=False),
        group(spec.distillation, ()),
    )
    total = len(keys)
    summed = total + 1 + value_flag_count(spec)
    state_rows = 0 if spec.gspo is None else len(STATE_ROWS) - (spec.distillation is None)
    return FusedLayout(*rows, total, total + 1, summed, summed if state_rows else -1, summed + state_rows, tuple(keys))


def fused_result(totals: torch.Tensor, layout: FusedLayout) -> tuple[LossResult, torch.Tensor]:
    """(loss, losses and metrics; value-check counts) from the token sums of the kernel's first
    `layout.summed` term rows."""
    values = totals.unbind()
    losses = {key: value for (is_loss, key), value in zip(layout.keys, values) if is_loss}
    metrics = {key: value for (is_loss, key), value in zip(layout.keys, values) if not is_loss}
    return LossResult(values[layout.total], losses, metrics), totals[layout.flags :]
