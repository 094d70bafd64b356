"""Plain PyTorch ground truth: each child's `reference` on one log-softmax, gradients by autograd.

Written straight from the formulas in the design doc (no shared statistics, no coefficients, per
document by a Python loop) so the fast paths are checked against something independent. Each child
returns this call's unweighted share of the step-wide loss. Run it in float64 for tests.
"""

from __future__ import annotations

import torch

from fastlm.losses.children.base import ReferenceInputs
from fastlm.losses.spec import IGNORE_INDEX, LossNormalizers, LossResult, LossSpec, LossTargets, transform_logits


def _label_logp(logits: torch.Tensor, labels: torch.Tensor, logit_scale: float, softcap: float | None) -> torch.Tensor:
    """log p(y_t) per token; 0 on masked tokens."""
    log_probs = torch.log_softmax(transform_logits(logits, logit_scale, softcap), dim=-1)
    return _pick(log_probs, labels)


def _pick(log_probs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    picked = log_probs.gather(-1, labels.clamp(min=0)[:, None])[:, 0]
    return torch.where(labels != IGNORE_INDEX, picked, torch.zeros_like(picked))


def reference_loss(logits: torch.Tensor, targets: LossTargets, normalizers: LossNormalizers, spec: LossSpec) -> LossResult:
    """Weighted sum of every present child; `loss` carries the autograd graph, `losses` are detached."""
    x = transform_logits(logits, spec.logit_scale, spec.softcap)
    log_probs = torch.log_softmax(x, dim=-1)
    inputs = ReferenceInputs(x, log_probs, _pick(log_probs, targets.labels), targets.labels != IGNORE_INDEX, targets,
                             normalizers)
    parts = [(child, child.reference(inputs)) for child in spec.children]
    loss = sum((child.weight * value for child, value in parts), logits.new_zeros(()))
    return LossResult(loss, {child.name: value.detach() for child, value in parts})
