"""Bad inputs raise ValueError naming the tensor, before any NaN can appear."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch
from loss_cases import make_case, make_spec, seed_of

from fastlm.losses.compiled import compiled_loss
from fastlm.losses.spec import LossNormalizers
from fastlm.losses.validation import collected_value_checks, deferred_value_checks


def _case(kinds: str):
    spec = make_spec(kinds)
    logits, targets, normalizers = make_case(seed_of("validation" + kinds), spec=spec)
    return spec, logits, targets, normalizers


def _first_unmasked(targets) -> int:
    return int((targets.labels != -100).nonzero()[0, 0])


def test_label_out_of_vocab() -> None:
    spec, logits, targets, normalizers = _case("ce")
    targets.labels[_first_unmasked(targets)] = logits.shape[1]
    with pytest.raises(ValueError, match=r"targets.labels\[\d+\] = 37 is outside the vocabulary \[0, 37\)"):
        compiled_loss(logits, targets, normalizers, spec)
    targets.labels[_first_unmasked(targets)] = -5
    with pytest.raises(ValueError, match="targets.labels"):
        compiled_loss(logits, targets, normalizers, spec)


@pytest.mark.parametrize("field", ["old_logp", "advantages"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_policy_inputs(field: str, value: float) -> None:
    spec, logits, targets, normalizers = _case("grpo")
    getattr(targets, field)[_first_unmasked(targets)] = value
    with pytest.raises(ValueError, match=f"targets.{field} has a non-finite value"):
        compiled_loss(logits, targets, normalizers, spec)


@pytest.mark.parametrize(
    "kinds,field,message",
    [
        ("grpo", "old_logp", "targets.old_logp is required"),
        ("gspo", "advantages", "targets.advantages is required"),
        ("gspo", "document_ids", "targets.document_ids is required"),
        ("kd", "teacher_logits", "targets.teacher_logits is required"),
    ],
)
def test_missing_inputs(kinds: str, field: str, message: str) -> None:
    spec, logits, targets, normalizers = _case(kinds)
    with pytest.raises(ValueError, match=message):
        compiled_loss(logits, dataclasses.replace(targets, **{field: None}), normalizers, spec)


def test_shape_mismatches() -> None:
    spec, logits, targets, normalizers = _case("ce+grpo+kd")
    with pytest.raises(ValueError, match="targets.labels must have shape"):
        compiled_loss(logits, dataclasses.replace(targets, labels=targets.labels[:-1]), normalizers, spec)
    with pytest.raises(ValueError, match="targets.old_logp must have shape"):
        compiled_loss(logits, dataclasses.replace(targets, old_logp=targets.old_logp[:-1]), normalizers, spec)
    with pytest.raises(ValueError, match="targets.teacher_logits must have the student's shape"):
        compiled_loss(logits, dataclasses.replace(targets, teacher_logits=targets.teacher_logits[:, :-1]), normalizers, spec)
    with pytest.raises(ValueError, match=r"logits must be \(tokens, vocab\)"):
        compiled_loss(logits[None], targets, normalizers, spec)


def test_bad_normalizers() -> None:
    spec, logits, targets, _ = _case("gspo")
    with pytest.raises(ValueError, match="normalizers.tokens"):
        compiled_loss(logits, targets, LossNormalizers(0.0, 3.0), spec)
    with pytest.raises(ValueError, match="normalizers.documents"):
        compiled_loss(logits, targets, LossNormalizers(10.0, 0.0), spec)


def test_masked_tokens_may_hold_anything() -> None:
    """NaN old_logp and any label value are ignored where the label is -100 (make_case writes NaN there)."""
    spec, logits, targets, normalizers = _case("grpo")
    assert torch.isnan(targets.old_logp[targets.labels == -100]).all()
    result, grad = compiled_loss(logits, targets, normalizers, spec)
    assert torch.isfinite(result.loss) and torch.isfinite(grad).all()


def test_deferred_checks_raise_at_block_end_naming_the_first_bad_call() -> None:
    """Inside `deferred_value_checks` a bad call returns; the block's end reads every call's counts
    once and raises the first failure (the trainer puts that before the optimizer step)."""
    spec, logits, targets, normalizers = _case("grpo")
    bad = dataclasses.replace(targets, advantages=targets.advantages.clone())
    bad.advantages[_first_unmasked(targets)] = float("nan")
    reached_end = False
    with pytest.raises(ValueError, match="targets.advantages has a non-finite value"):
        with deferred_value_checks():
            compiled_loss(logits, targets, normalizers, spec)
            compiled_loss(logits, bad, normalizers, spec)  # no raise yet
            compiled_loss(logits, targets, normalizers, spec)
            reached_end = True
    assert reached_end
    with deferred_value_checks():  # good calls only: nothing raised, and the next call checks at once again
        result, _ = compiled_loss(logits, targets, normalizers, spec)
    assert torch.isfinite(result.loss)
    with pytest.raises(ValueError, match="targets.advantages"):
        compiled_loss(logits, bad, normalizers, spec)


def test_deferred_checks_leave_an_exception_from_the_block_alone() -> None:
    spec, logits, targets, normalizers = _case("ce")
    targets.labels[_first_unmasked(targets)] = logits.shape[1]
    with pytest.raises(RuntimeError, match="from the block"):
        with deferred_value_checks():
            compiled_loss(logits, targets, normalizers, spec)
            raise RuntimeError("from the block")


def test_deferred_check_keeps_no_teacher_logits_alive() -> None:
    """A step's pending checks hold per-token inputs only: each micro-batch's (tokens, vocab) teacher
    logits can be freed before the step ends (the trainer makes them per micro-batch for that reason)."""
    spec, logits, targets, normalizers = _case("ce+kd")
    teacher = weakref.ref(targets.teacher_logits)
    with deferred_value_checks():
        compiled_loss(logits, targets, normalizers, spec)
        del targets
        gc.collect()
        assert teacher() is None


def _mutated(kinds: str, change: str):
    spec, logits, targets, normalizers = _case(kinds)
    first = _first_unmasked(targets)
    if change == "label":
        targets.labels[first] = logits.shape[1]
    elif change in ("old_logp", "advantages"):
        getattr(targets, change)[first] = float("nan")
    elif change == "tokens":
        normalizers = LossNormalizers(0.0, normalizers.documents)
    elif change == "documents":
        normalizers = LossNormalizers(normalizers.tokens, 0.0)
    elif change == "all masked":
        targets.labels[:] = -100
        normalizers = LossNormalizers(0.0, 0.0)
    return spec, logits, targets, normalizers


@pytest.mark.parametrize(
    "kinds,change,bad",
    [("ce", "none", False), ("ce", "label", True), ("grpo", "old_logp", True), ("grpo", "advantages", True),
     ("ce", "tokens", True), ("gspo", "documents", True), ("ce+grpo", "all masked", False)],
)
def test_device_flag_agrees_with_the_read_check(kinds: str, change: str, bad: bool) -> None:
    """`ValueCheck.fails()` (what the trainer skips its update on, unread) is true exactly when reading the
    counts raises."""
    spec, logits, targets, normalizers = _mutated(kinds, change)
    with collected_value_checks() as checks:
        compiled_loss(logits, targets, normalizers, spec)
    (check,) = checks
    try:
        check.raise_if_bad(check.counts.tolist())
        raised = False
    except ValueError:
        raised = True
    assert bool(check.fails()) == raised == bad
