"""Plain PyTorch ground truth: each child's `reference` on one log-softmax, gradients by autograd.

Written straight from the formulas in the design doc (no shared statistics, no coefficients, per
document by a Python loop) so the fast paths are checked against something independent. Each child
returns this call's unweighted share of the step-wide loss. Run it in float64 for tests.
"""

from __future__ import annotations

import torch

from fastlm.losses.children.base import ReferenceInputs
from fastlm.losses.spec import LossSpec
from fastlm.losses.tensors import IGNORE_INDEX, LossNormalizers, LossResult, LossTargets, pick_labels, transform_logits


def reference_loss(logits: torch.Tensor, targets: LossTargets, normalizers: LossNormalizers, spec: LossSpec) -> LossResult:
    """Weighted sum of every present child; `loss` carries the autograd graph, `losses` are detached."""
    x = transform_logits(logits, spec.logit_scale, spec.softcap)
    log_probs = torch.log_softmax(x, dim=-1)
    inputs = ReferenceInputs(x, log_probs, pick_labels(log_probs, targets.labels), targets.labels != IGNORE_INDEX, targets,
                             normalizers)
    parts = [(child, child.reference(inputs)) for child in spec.children]
    loss = sum((child.weight * value for child, value in parts), logits.new_zeros(()))
    return LossResult(loss, {child.name: value.detach() for child, value in parts})
