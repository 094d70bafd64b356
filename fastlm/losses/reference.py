"""Plain PyTorch ground truth: one function per child, gradients by autograd.

Written straight from the formulas in the design doc (no shared softmax, no coefficients, GSPO by a
Python loop over documents) so the fast paths are checked against something independent. Each
function takes raw logits, applies `transform_logits`, and returns this call's unweighted share of
the step-wide loss (sums over unmasked tokens divided by the step-wide normaliser). Run it in
float64 for tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastlm.losses.spec import (
    IGNORE_INDEX,
    ClippedPolicySpec,
    DistillationSpec,
    GSPOSpec,
    LossNormalizers,
    LossResult,
    LossSpec,
    LossTargets,
    transform_logits,
)


def _log_probs(logits: torch.Tensor, logit_scale: float, softcap: float | None) -> torch.Tensor:
    return torch.log_softmax(transform_logits(logits, logit_scale, softcap), dim=-1)


def _label_logp(logits: torch.Tensor, labels: torch.Tensor, logit_scale: float, softcap: float | None) -> torch.Tensor:
    """log p(y_t) per token; 0 on masked tokens."""
    mask = labels != IGNORE_INDEX
    picked = _log_probs(logits, logit_scale, softcap).gather(-1, labels.clamp(min=0)[:, None])[:, 0]
    return torch.where(mask, picked, torch.zeros_like(picked))


def _per_token(count: float) -> float:
    return 1.0 / count if count > 0 else 0.0


def cross_entropy(
    logits: torch.Tensor, targets: LossTargets, normalizers: LossNormalizers, logit_scale: float = 1.0, softcap: float | None = None
) -> torch.Tensor:
    x = transform_logits(logits, logit_scale, softcap)
    total = F.cross_entropy(x, targets.labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return total * _per_token(normalizers.tokens)


def z_loss(
    logits: torch.Tensor, targets: LossTargets, normalizers: LossNormalizers, logit_scale: float = 1.0, softcap: float | None = None
) -> torch.Tensor:
    lse = torch.logsumexp(transform_logits(logits, logit_scale, softcap), dim=-1)
    mask = targets.labels != IGNORE_INDEX
    return (lse.square() * mask).sum() * _per_token(normalizers.tokens)


def _clipped_objective(ratio: torch.Tensor, advantage: torch.Tensor, child: ClippedPolicySpec) -> torch.Tensor:
    return -torch.min(ratio * advantage, ratio.clamp(1.0 - child.eps_low, 1.0 + child.eps_high) * advantage)


def grpo(
    logits: torch.Tensor,
    targets: LossTargets,
    normalizers: LossNormalizers,
    child: ClippedPolicySpec,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    mask = targets.labels != IGNORE_INDEX
    new_logp = _label_logp(logits, targets.labels, logit_scale, softcap)
    ratio = torch.exp(new_logp[mask] - targets.old_logp[mask].to(new_logp.dtype))
    advantage = targets.advantages[mask].to(new_logp.dtype)
    return _clipped_objective(ratio, advantage, child).sum() * _per_token(normalizers.tokens)


def gspo(
    logits: torch.Tensor,
    targets: LossTargets,
    normalizers: LossNormalizers,
    child: GSPOSpec,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    mask = targets.labels != IGNORE_INDEX
    new_logp = _label_logp(logits, targets.labels, logit_scale, softcap)
    total = new_logp.new_zeros(())
    for document in targets.document_ids[mask].unique().tolist():
        tokens = mask & (targets.document_ids == document)
        delta = new_logp[tokens] - targets.old_logp[tokens].to(new_logp.dtype)
        ratio = torch.exp(delta.mean())
        advantage = targets.advantages[tokens].to(new_logp.dtype).mean()
        loss = _clipped_objective(ratio, advantage, child)
        total = total + (loss * int(tokens.sum()) if child.length_proportional else loss)
    count = normalizers.tokens if child.length_proportional else normalizers.documents
    return total * _per_token(count)


def distillation(
    logits: torch.Tensor,
    targets: LossTargets,
    normalizers: LossNormalizers,
    child: DistillationSpec,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """Forward KL(q || p) or reverse KL(p || q); q = softmax(teacher/T), p the student's (untempered) softmax."""
    mask = targets.labels != IGNORE_INDEX
    student = _log_probs(logits, logit_scale, softcap)
    teacher = torch.log_softmax(targets.teacher_logits.to(student.dtype) / child.temperature, dim=-1)
    if child.reverse:
        per_token = (student.exp() * (student - teacher)).sum(-1)
    else:
        per_token = (teacher.exp() * (teacher - student)).sum(-1)
    return (per_token * mask).sum() * _per_token(normalizers.tokens)


def reference_loss(logits: torch.Tensor, targets: LossTargets, normalizers: LossNormalizers, spec: LossSpec) -> LossResult:
    """Weighted sum of every present child; `loss` carries the autograd graph, `losses` are detached."""
    numbers = (spec.logit_scale, spec.softcap)
    parts: list[tuple[str, float, torch.Tensor]] = []
    if spec.cross_entropy is not None:
        parts.append((spec.cross_entropy.name, spec.cross_entropy.weight, cross_entropy(logits, targets, normalizers, *numbers)))
    if spec.z_loss is not None:
        parts.append((spec.z_loss.name, spec.z_loss.weight, z_loss(logits, targets, normalizers, *numbers)))
    if spec.grpo is not None:
        parts.append((spec.grpo.name, spec.grpo.weight, grpo(logits, targets, normalizers, spec.grpo, *numbers)))
    if spec.gspo is not None:
        parts.append((spec.gspo.name, spec.gspo.weight, gspo(logits, targets, normalizers, spec.gspo, *numbers)))
    if spec.distillation is not None:
        child = spec.distillation
        parts.append((child.name, child.weight, distillation(logits, targets, normalizers, child, *numbers)))
    loss = sum((weight * value for _, weight, value in parts), logits.new_zeros(()))
    return LossResult(loss, {name: value.detach() for name, _, value in parts})
