"""Compiled loss behaviour beyond single-call parity: autograd wrapper, scaling, dtypes, chunking,
accumulation, weight-0 children, packed GSPO documents, all-masked batches, metrics."""

from __future__ import annotations

import math

import pytest
import torch
from loss_cases import compare, make_case, make_spec, reference_with_grad, rel_err, seed_of

from fastlm.losses.compiled import compiled_loss
from fastlm.losses.dispatch import monolithic_loss
from fastlm.losses.metrics import k3_kl
from fastlm.losses.spec import IGNORE_INDEX, LossNormalizers, LossTargets, label_logp


@pytest.mark.parametrize("grad_output", [1.0, 0.37])
def test_autograd_wrapper_scales_by_grad_scale_and_grad_output(grad_output: float) -> None:
    spec = make_spec("ce+z+grpo")
    logits, targets, normalizers = make_case(seed_of("autograd"), spec=spec)
    leaf = logits.clone().requires_grad_(True)
    result = monolithic_loss(leaf, targets, normalizers, spec, "compiled", grad_scale=2.5)
    (result.loss * grad_output).backward()
    expected, expected_grad = reference_with_grad(logits, targets, normalizers, spec, grad_scale=2.5 * grad_output)
    compare(f"autograd grad_output={grad_output}", result, leaf.grad, expected, expected_grad, tolerance=1e-6)


def test_no_grad_call_skips_the_gradient() -> None:
    spec = make_spec("ce")
    logits, targets, normalizers = make_case(seed_of("nograd"), spec=spec)
    with torch.no_grad():
        result = monolithic_loss(logits.requires_grad_(True), targets, normalizers, spec, "compiled")
    _, grad = compiled_loss(logits, targets, normalizers, spec, compute_grad=False)
    assert grad is None and result.loss.grad_fn is None and result.loss > 0


@pytest.mark.parametrize("dtype,tolerance", [(torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
def test_half_precision_logits(dtype: torch.dtype, tolerance: float) -> None:
    """16-bit logits: fp32 math inside, gradient stored in the logits dtype (rounding bounds the error)."""
    spec = make_spec("ce+z+gspo+kd_rev", softcap=4.0)
    logits, targets, normalizers = make_case(seed_of(str(dtype)), dtype=dtype, spec=spec)
    result, grad = compiled_loss(logits, targets, normalizers, spec, grad_scale=3.0)
    assert grad.dtype == dtype
    expected, expected_grad = reference_with_grad(logits, targets, normalizers, spec, grad_scale=3.0)
    compare(f"{dtype}", result, grad, expected, expected_grad, tolerance=tolerance)


def test_chunking_gives_identical_results() -> None:
    whole = make_spec("ce+z+gspo+kd", chunk_tokens=4096)
    chunked = make_spec("ce+z+gspo+kd", chunk_tokens=5)
    logits, targets, normalizers = make_case(seed_of("chunks"), tokens=23, spec=whole)
    result, grad = compiled_loss(logits, targets, normalizers, whole)
    result_c, grad_c = compiled_loss(logits, targets, normalizers, chunked)
    errors = [rel_err(grad_c, grad)] + [rel_err(result_c.losses[k], v) for k, v in result.losses.items()]
    print(f"chunked vs whole: max rel err {max(errors):.2e}")
    assert max(errors) < 1e-6
    assert result_c.metrics.keys() == result.metrics.keys()


def _split(targets: LossTargets, rows: slice) -> LossTargets:
    pick = lambda t: None if t is None else t[rows]  # noqa: E731
    return LossTargets(
        *(pick(getattr(targets, f)) for f in ("labels", "old_logp", "advantages", "document_ids", "teacher_logits"))
    )


@pytest.mark.parametrize("kinds", ["ce+z+grpo", "gspo_len+kd", "gspo"])
def test_accumulation_equals_one_batch(kinds: str) -> None:
    """Two micro-batches with step-wide normalizers sum to the one-batch losses, metrics and gradient."""
    spec = make_spec(kinds)
    logits, targets, normalizers = make_case(seed_of("accumulate" + kinds), tokens=30, spec=spec)
    ids = targets.document_ids
    ids[-2:] = ids[-3]  # undo the split-in-two document so no GSPO document straddles the micro-batches
    cut = next(t for t in range(15, len(ids)) if ids[t] != ids[t - 1])  # a document boundary
    mask = targets.labels != IGNORE_INDEX
    normalizers = LossNormalizers(float(mask.sum()), float(targets.document_ids[mask].unique().numel()))
    result, grad = compiled_loss(logits, targets, normalizers, spec)
    parts = [compiled_loss(logits[rows], _split(targets, rows), normalizers, spec) for rows in (slice(0, cut), slice(cut, None))]
    summed_grad = torch.cat([g for _, g in parts])
    errors = {"grad": rel_err(summed_grad, grad), "total": rel_err(parts[0][0].loss + parts[1][0].loss, result.loss)}
    errors.update({k: rel_err(parts[0][0].metrics[k] + parts[1][0].metrics[k], v) for k, v in result.metrics.items()})
    print(f"accumulation {kinds}: max rel err {max(errors.values()):.2e}")
    assert max(errors.values()) < 1e-6, errors


@pytest.mark.parametrize("kinds,zeroed", [("ce+z+grpo", "grpo"), ("ce+gspo", "gspo"), ("ce+kd", "kd"), ("ce+z", "z")])
def test_weight_zero_child_keeps_metrics_and_writes_no_gradient(kinds: str, zeroed: str) -> None:
    spec = make_spec(kinds, weights={zeroed: 0.0})
    without = make_spec("+".join(k for k in kinds.split("+") if k != zeroed))
    logits, targets, normalizers = make_case(seed_of("zero" + kinds), spec=spec)
    result, grad = compiled_loss(logits, targets, normalizers, spec)
    result_w, grad_w = compiled_loss(logits, targets, normalizers, without)
    assert torch.equal(grad, grad_w)
    assert torch.allclose(result.loss, result_w.loss)
    assert result.losses[zeroed] != 0
    if zeroed != "kd":  # distillation logs its loss only
        own = [k for k in result.metrics if k.startswith(f"{zeroed}/")]
        assert own and all(torch.isfinite(result.metrics[k]) for k in own)


def test_gspo_packed_documents_and_metrics() -> None:
    """Several documents per row, each a run of equal ids (the first id is used again by the last run:
    another document): seam vs a per-document loop."""
    spec = make_spec("gspo")
    logits, targets, normalizers = make_case(seed_of("gspo-docs"), tokens=40, spec=spec)
    result, _ = compiled_loss(logits, targets, normalizers, spec)
    mask = targets.labels != IGNORE_INDEX
    new_logp = label_logp(logits.double(), targets.labels)
    ids = targets.document_ids.tolist()
    starts = [t for t in range(len(ids)) if t == 0 or ids[t] != ids[t - 1]] + [len(ids)]
    documents = [torch.arange(len(ids)).ge(a) & torch.arange(len(ids)).lt(b) & mask for a, b in zip(starts, starts[1:])]
    documents = [rows for rows in documents if rows.any()]
    assert len(documents) >= 5 and ids[0] == ids[-1]
    ratios, low, high = [], 0, 0
    for rows in documents:
        ratio = math.exp(float((new_logp[rows] - targets.old_logp[rows].double()).mean()))
        advantage = float(targets.advantages[rows].mean())
        ratios.append(ratio)
        low += ratio < 1 - spec.children[0].eps_low and advantage < 0
        high += ratio > 1 + spec.children[0].eps_high and advantage > 0
    m = result.metrics
    assert float(m["gspo/num_documents"]) == len(documents)
    assert abs(float(m["gspo/ratio"]) - sum(ratios) / normalizers.documents) < 1e-6
    assert float(m["gspo/clip_ratio/low_mean"]) == pytest.approx(low / normalizers.documents)
    assert float(m["gspo/clip_ratio/high_mean"]) == pytest.approx(high / normalizers.documents)
    assert low + high > 0, "the case should exercise clipping"
    kl = k3_kl(new_logp[mask], targets.old_logp[mask].double()).sum() / normalizers.tokens
    assert abs(float(m["gspo/kl_old"]) - float(kl)) < 1e-6 and float(kl) > 0


def test_grpo_metrics_match_hand_formulas() -> None:
    spec = make_spec("grpo")
    logits, targets, normalizers = make_case(seed_of("grpo-metrics"), spec=spec)
    result, _ = compiled_loss(logits, targets, normalizers, spec)
    mask = targets.labels != IGNORE_INDEX
    log_probs = torch.log_softmax(logits.double(), -1)[mask]
    new_logp = log_probs.gather(-1, targets.labels[mask][:, None])[:, 0]
    ratio = torch.exp(new_logp - targets.old_logp[mask].double())
    n = normalizers.tokens
    expected = {
        "grpo/new_logp": new_logp.sum() / n,
        "grpo/ratio": ratio.sum() / n,
        "grpo/entropy": -(log_probs.exp() * log_probs).sum() / n,
        "grpo/advantage": targets.advantages[mask].double().sum() / n,
        "grpo/clip_ratio/region_mean": (
            ((ratio < 0.8) & (targets.advantages[mask] < 0)) | ((ratio > 1.25) & (targets.advantages[mask] > 0))
        ).sum() / n,
    }
    for key, value in expected.items():
        print(f"{key}: {float(result.metrics[key]):.6f} vs {float(value):.6f}")
        assert abs(float(result.metrics[key]) - float(value)) < 1e-6
    assert float(expected["grpo/clip_ratio/region_mean"]) > 0


@pytest.mark.parametrize("kinds", ["ce+z+grpo", "gspo+kd_rev", "gspo_len+kd"])
def test_all_masked_batch_is_zero_not_nan(kinds: str) -> None:
    spec = make_spec(kinds)
    logits, targets, _ = make_case(seed_of("masked" + kinds), spec=spec, masked=1.0)
    result, grad = compiled_loss(logits, targets, LossNormalizers(0.0, 0.0), spec)
    assert float(result.loss) == 0.0 and torch.count_nonzero(grad) == 0
    assert all(torch.isfinite(v) for v in [*result.losses.values(), *result.metrics.values()])
