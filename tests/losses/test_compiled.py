"""Compiled monolithic loss vs the float64 reference: every child and subset, forward and gradient."""

from __future__ import annotations

import pytest
from loss_cases import compare, make_case, make_spec, reference_with_grad, seed_of

from fastlm.losses.compiled import compiled_loss

SUBSETS = [
    "ce", "z", "grpo", "gspo", "gspo_len", "kd", "kd_rev",
    "ce+z", "grpo+z", "gspo+z", "ce+grpo", "ce+kd", "ce+kd_rev", "ce+z+grpo", "ce+z+gspo+kd",
    "kd_both", "ce+kd_rev_both", "ce+z+grpo+kd_both",  # distillation temperature_mode both
]


@pytest.mark.parametrize("kinds", SUBSETS)
@pytest.mark.parametrize(
    "numbers", [{}, {"logit_scale": 0.7}, {"softcap": 3.0, "logit_scale": 1.3}], ids=["plain", "scale", "softcap"]
)
def test_subset_matches_reference(kinds: str, numbers: dict[str, float]) -> None:
    spec = make_spec(kinds, **numbers)
    logits, targets, normalizers = make_case(seed=seed_of(kinds), vocab=37, spec=spec)
    result, grad = compiled_loss(logits, targets, normalizers, spec, grad_scale=1.0)
    expected, expected_grad = reference_with_grad(logits, targets, normalizers, spec)
    compare(f"{kinds} {numbers}", result, grad, expected, expected_grad, tolerance=1e-6)
