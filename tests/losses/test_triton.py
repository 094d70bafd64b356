"""The fused Triton loss kernel: half precision, per-document children, accumulation, in place,
masked rows, dispatch, bad input, tensor parallelism, prefetch (the every-child matrix against
float64 and the compiled path is test_matrix.py).

Without CUDA the kernel runs on Triton's CPU interpreter (env var set before triton is imported), so
shapes stay tiny; `max_block=128` forces the looped multi-block path with a non-power-of-two tail.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch.distributed as dist

from fastlm.losses.children import GRPO as GRPOChild
from fastlm.losses.children import GSPO as GSPOChild
from fastlm.losses.children import CrossEntropy, ZLoss
from fastlm.losses.compiled import compiled_loss
from fastlm.losses.dispatch import monolithic_loss
from fastlm.losses.function import LossImplementation
from fastlm.losses.reference import reference_loss
from fastlm.losses.spec import LossNormalizers, LossResult, LossSpec, LossTargets
from fastlm.losses.triton import triton_loss
from fastlm.losses.validation import deferred_value_checks
from tests.distributed.dist_helpers import spawn_ranks

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP32_TOL = 1e-5  # observed ~1e-7..1e-6 against float64
HALF_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2}  # logits rounded to 16 bits before the loss

CE = CrossEntropy("ce", 1.0)
Z = ZLoss("z", 0.1)
GRPO = GRPOChild("grpo", 1.0, eps_low=0.2, eps_high=0.3)
GSPO = GSPOChild("gspo", 1.0, eps_low=0.05, eps_high=0.08)


def _make_case(
    tokens: int, vocab: int, seed: int, dtype: torch.dtype = torch.float32, documents: int = 1, masked: float = 0.25
) -> tuple[torch.Tensor, LossTargets]:
    """Random logits and targets; old_logp near new_logp so ratios straddle both clip bounds."""
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, vocab, generator=generator) * 2.0).to(dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    labels[torch.rand(tokens, generator=generator) < masked] = -100
    new_logp = torch.log_softmax(logits.double(), -1).gather(1, labels.clamp(min=0)[:, None])[:, 0]
    old_logp = (new_logp + torch.randn(tokens, generator=generator, dtype=torch.float64) * 0.2).float()
    advantages = torch.randn(tokens, generator=generator)
    # Packed rows: `documents` contiguous documents per row of 8 tokens, ids unique over the batch.
    document_ids = torch.arange(tokens) // max(1, 8 // documents)
    targets = LossTargets(labels, old_logp, advantages, document_ids)
    return logits.to(DEVICE), _to_device(targets)


def _to_device(targets: LossTargets) -> LossTargets:
    return LossTargets(*(t.to(DEVICE) if t is not None else None for t in
                         (targets.labels, targets.old_logp, targets.advantages, targets.document_ids)))


def _normalizers(targets: LossTargets) -> LossNormalizers:
    mask = targets.labels != -100
    return LossNormalizers(float(mask.sum()), float(targets.document_ids[mask].unique().numel()))


def _reference(
    logits: torch.Tensor, targets: LossTargets, normalizers: LossNormalizers, spec: LossSpec, grad_scale: float = 1.0
) -> tuple[LossResult, torch.Tensor]:
    """float64 ground truth: loss, per-child losses and d(loss*grad_scale)/d(logits) by autograd."""
    z = logits.detach().double().requires_grad_()
    double = replace(targets, old_logp=targets.old_logp.double(), advantages=targets.advantages.double())
    result = reference_loss(z, double, normalizers, spec)
    (result.loss * grad_scale).backward()
    return result, z.grad


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm().clamp(min=1e-12))


def _check(
    label: str, result: LossResult, grad: torch.Tensor, expected: LossResult, expected_grad: torch.Tensor, tol: float
) -> None:
    errors = {"loss": _rel(result.loss, expected.loss), "grad": _rel(grad, expected_grad)}
    errors.update({name: _rel(result.losses[name], value) for name, value in expected.losses.items()})
    print(f"{label}: relative errors " + ", ".join(f"{k}={v:.2e}" for k, v in errors.items()))
    assert set(result.losses) == set(expected.losses)
    assert torch.isfinite(grad).all()
    assert max(errors.values()) < tol, errors


def _check_metrics(result: LossResult, expected: LossResult, tol: float) -> None:
    """Same metric keys as the compiled path, same values."""
    assert set(result.metrics) == set(expected.metrics)
    for key, value in expected.metrics.items():
        scale = max(1.0, float(value.abs()))
        assert abs(float(result.metrics[key]) - float(value)) <= tol * scale, (key, result.metrics[key], value)


SPECS = {
    "ce": LossSpec((CE,)),
    "ce+z": LossSpec((CE, Z)),
    "grpo+z scaled": LossSpec((Z, GRPO), logit_scale=0.7),
    "ce+z+grpo softcap": LossSpec((CrossEntropy("ce", 0.5), Z, GRPO), logit_scale=1.3, softcap=4.0),
}
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block", [128, 32768])
def test_half_precision_logits(dtype: torch.dtype, block: int) -> None:
    """16-bit logits are upcast in-kernel; the gradient comes back in the logits dtype."""
    spec = SPECS["ce+z+grpo softcap"]
    logits, targets = _make_case(16, 300, seed=7, dtype=dtype)
    normalizers = _normalizers(targets)
    result, grad = triton_loss(logits, targets, normalizers, spec, max_block=block)
    assert grad.dtype == dtype
    expected, expected_grad = _reference(logits, targets, normalizers, spec)
    _check(f"{dtype} block={block}", result, grad, expected, expected_grad, HALF_TOL[dtype])


@pytest.mark.parametrize("spec", [
    LossSpec((GSPO,)),
    LossSpec((Z, replace(GSPO, loss_type="dapo")), softcap=3.0),
    LossSpec((CE, GRPO, replace(GSPO, eps_low=0.2, eps_high=0.3))),
], ids=["gspo", "gspo-length+z+softcap", "ce+grpo+gspo"])
@pytest.mark.parametrize("block", [128, 512])
def test_gspo_packed_documents(spec: LossSpec, block: int) -> None:
    """Several documents per row: fused launch without gradient, eager seam, grad launch."""
    logits, targets = _make_case(32, 300, seed=11, documents=4)
    normalizers = _normalizers(targets)
    assert normalizers.documents >= 8
    result, grad = triton_loss(logits, targets, normalizers, spec, grad_scale=2.0, max_block=block)
    expected, expected_grad = _reference(logits, targets, normalizers, spec, grad_scale=2.0)
    names = "+".join(child.name for child in spec.children)
    _check(f"{names} block={block}", result, grad, expected, expected_grad, FP32_TOL)
    compiled, _ = compiled_loss(logits, targets, normalizers, spec, grad_scale=2.0)
    _check_metrics(result, compiled, FP32_TOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA's sync detection; runs on the H200 (docs/benchmarks.md)")
@pytest.mark.parametrize("implementation", [triton_loss, compiled_loss], ids=["triton", "compiled"])
def test_gspo_call_queues_without_a_sync(implementation: LossImplementation) -> None:
    """Inside `deferred_value_checks` a GSPO call (seam included) never makes the host wait for the GPU."""
    spec = LossSpec((CE, Z, GSPO))
    logits, targets = _make_case(64, 300, seed=5, documents=4)
    normalizers = _normalizers(targets)
    implementation(logits, targets, normalizers, spec)  # compiles (the compiled path syncs while compiling)
    with deferred_value_checks():
        torch.cuda.set_sync_debug_mode("error")
        try:
            result, grad = implementation(logits, targets, normalizers, spec)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    expected, expected_grad = _reference(logits, targets, normalizers, spec)
    _check(f"{implementation.__name__} under sync detection", result, grad, expected, expected_grad, FP32_TOL)


@pytest.mark.parametrize("block", [128, 32768])
def test_gradient_accumulation_equals_one_batch(block: int) -> None:
    """Two micro-batches with step-wide normalizers sum to the gradient and loss of one big batch."""
    spec = SPECS["ce+z+grpo softcap"]
    logits, targets = _make_case(32, 300, seed=3)
    normalizers = _normalizers(targets)
    whole, whole_grad = triton_loss(logits, targets, normalizers, spec, max_block=block)
    parts = [triton_loss(logits[rows], LossTargets(*(t[rows] for t in (targets.labels, targets.old_logp,
             targets.advantages, targets.document_ids))), normalizers, spec, max_block=block)
             for rows in (slice(0, 13), slice(13, 32))]
    loss = parts[0][0].loss + parts[1][0].loss
    grad = torch.cat([parts[0][1], parts[1][1]])
    print(f"accumulation block={block}: loss rel {_rel(loss, whole.loss):.2e}, grad rel {_rel(grad, whole_grad):.2e}")
    assert _rel(loss, whole.loss) < FP32_TOL and _rel(grad, whole_grad) < FP32_TOL
    for key, value in whole.metrics.items():
        assert abs(float(parts[0][0].metrics[key] + parts[1][0].metrics[key] - value)) < FP32_TOL * max(1.0, float(value.abs()))


def test_weight_zero_child_logs_metrics_without_gradient() -> None:
    spec = LossSpec((CE, replace(Z, weight=0.0), replace(GRPO, weight=0.0)))
    logits, targets = _make_case(16, 300, seed=5)
    normalizers = _normalizers(targets)
    result, grad = triton_loss(logits, targets, normalizers, spec, max_block=128)
    ce_only, ce_grad = triton_loss(logits, targets, normalizers, LossSpec((CE,)), max_block=128)
    print(f"weight 0: grad rel to CE-only {_rel(grad, ce_grad):.2e}")
    assert _rel(grad, ce_grad) < 1e-7
    assert {"grpo/kl_old", "grpo/entropy", "grpo/clip_ratio/region_mean", "z/lse"} <= set(result.metrics)
    assert float(result.losses["grpo"]) != 0.0 and float(result.losses["z"]) > 0.0
    compiled, _ = compiled_loss(logits, targets, normalizers, spec)
    _check_metrics(result, compiled, FP32_TOL)
    torch.testing.assert_close(result.loss, ce_only.loss)


@pytest.mark.parametrize("spec", [SPECS["ce+z+grpo softcap"], LossSpec((Z, GSPO))], ids=["fused", "gspo"])
@pytest.mark.parametrize("block", [128, 512])
def test_inplace_gradient_overwrites_logits(spec: LossSpec, block: int) -> None:
    logits, targets = _make_case(16, 300, seed=9, dtype=torch.bfloat16, documents=2)
    normalizers = _normalizers(targets)
    _, fresh = triton_loss(logits, targets, normalizers, spec, max_block=block)
    buffer = logits.clone()
    _, grad = triton_loss(buffer, targets, normalizers, spec, max_block=block, inplace=True)
    assert grad.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(grad, fresh, rtol=0, atol=0)


@pytest.mark.parametrize("spec", [SPECS["ce+z+grpo softcap"], LossSpec((Z, GSPO))], ids=["fused", "gspo"])
def test_all_masked_batch_is_zero_not_nan(spec: LossSpec) -> None:
    logits, targets = _make_case(8, 300, seed=2, masked=1.0)
    normalizers = LossNormalizers(tokens=0.0, documents=0.0)
    result, grad = triton_loss(logits, targets, normalizers, spec, max_block=128)
    assert float(result.loss) == 0.0 and all(float(v) == 0.0 for v in result.losses.values())
    assert all(torch.isfinite(v).all() for v in result.metrics.values())
    assert torch.count_nonzero(grad) == 0


def test_masked_rows_get_zero_gradient_and_no_grad_mode() -> None:
    spec = SPECS["ce+z"]
    logits, targets = _make_case(16, 300, seed=4, masked=0.5)
    normalizers = _normalizers(targets)
    result, grad = triton_loss(logits, targets, normalizers, spec, max_block=128)
    assert torch.count_nonzero(grad[targets.labels == -100]) == 0
    forward_only, none = triton_loss(logits, targets, normalizers, spec, max_block=128, compute_grad=False)
    assert none is None
    torch.testing.assert_close(forward_only.loss, result.loss)


def test_through_dispatch_and_autograd() -> None:
    """The autograd Function replays the kernel's gradient times grad_output into logits.grad."""
    spec = SPECS["ce+z+grpo softcap"]
    logits, targets = _make_case(16, 300, seed=8)
    normalizers = _normalizers(targets)
    leaf = logits.clone().requires_grad_()
    result = monolithic_loss(leaf, targets, normalizers, spec, "triton")
    (result.loss * 0.5).backward()
    expected, expected_grad = _reference(logits, targets, normalizers, spec, grad_scale=0.5)
    print(f"dispatch: loss rel {_rel(result.loss, expected.loss):.2e}, grad rel {_rel(leaf.grad, expected_grad):.2e}")
    assert _rel(result.loss, expected.loss) < FP32_TOL and _rel(leaf.grad, expected_grad) < FP32_TOL


def test_bad_input_is_named() -> None:
    logits, targets = _make_case(8, 37, seed=1)
    normalizers = _normalizers(targets)
    with pytest.raises(ValueError, match="stride 1"):
        triton_loss(logits.t().contiguous().t(), targets, normalizers, SPECS["ce"])
    with pytest.raises(ValueError, match="max_block"):
        triton_loss(logits, targets, normalizers, SPECS["ce"], max_block=100)
    bad = replace(targets, labels=targets.labels.clone().fill_(37))
    with pytest.raises(ValueError, match="targets.labels"):
        triton_loss(logits, bad, normalizers, SPECS["ce"])


TP_SPECS = {"ce+z+grpo softcap": SPECS["ce+z+grpo softcap"], "gspo+z": LossSpec((Z, GSPO), logit_scale=0.8)}


def _tp_worker(rank: int, world: int, folder: str) -> None:
    """One rank of a vocab-parallel head: its half of the vocab, global labels; saves its results."""
    saved = {}
    for name, spec in TP_SPECS.items():
        logits, targets = _make_case(16, 300, seed=21, documents=2)
        shard = logits.chunk(world, dim=1)[rank].contiguous()
        result, grad = triton_loss(shard, targets, _normalizers(targets), spec, group=dist.group.WORLD, max_block=64)
        saved[name] = (result.loss, result.losses, result.metrics, grad)
    torch.save(saved, os.path.join(folder, f"rank{rank}.pt"))


def test_tensor_parallel_two_ranks_match_single_rank(tmp_path: os.PathLike) -> None:
    """gloo, world size 2: each rank holds 150 of 300 vocab ids (looped blocks of 64 with a tail)."""
    world = 2
    spawn_ranks(_tp_worker, str(tmp_path), world=world)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    logits, targets = _make_case(16, 300, seed=21, documents=2)
    normalizers = _normalizers(targets)
    for name, spec in TP_SPECS.items():
        single, single_grad = triton_loss(logits, targets, normalizers, spec, max_block=64)
        expected, expected_grad = _reference(logits, targets, normalizers, spec)
        grad = torch.cat([saved[name][3] for saved in ranks], dim=1)
        for rank, saved in enumerate(ranks):
            tp = LossResult(*saved[name][:3])
            _check(f"TP {name} rank {rank}", tp, grad, expected, expected_grad, FP32_TOL)
            _check_metrics(tp, single, FP32_TOL)
        print(f"TP {name}: grad rel to single rank {_rel(grad, single_grad):.2e}")
        assert _rel(grad, single_grad) < FP32_TOL


@pytest.mark.parametrize("spec", [SPECS["ce+z+grpo softcap"], LossSpec((CE, Z, GSPO))],
                         ids=["fused", "gspo"])
def test_prefetch_changes_no_arithmetic(spec: LossSpec) -> None:
    """Loading each vocab block an iteration ahead (looped rows) computes what the plain loop does: bit
    for bit on the interpreter; compiled, the two variants may contract multiply-adds differently
    (seen on the H200: 1 ulp on 0.8% of the elements), so within 1e-6 there. In place too."""
    logits, targets = _make_case(12, 300, seed=13, documents=2)
    normalizers = _normalizers(targets)
    plain, plain_grad = triton_loss(logits, targets, normalizers, spec, max_block=128, prefetch=False)
    result, grad = triton_loss(logits, targets, normalizers, spec, max_block=128, prefetch=True)
    _, in_place = triton_loss(logits.clone(), targets, normalizers, spec, max_block=128, inplace=True, prefetch=True)
    tol = 0.0 if DEVICE.type == "cpu" else 1e-6
    for value, expected in ((grad, plain_grad), (in_place, plain_grad), (result.loss, plain.loss)):
        assert _rel(value, expected) <= tol, _rel(value, expected)
    expected, expected_grad = _reference(logits, targets, normalizers, spec)
    _check("prefetch", result, grad, expected, expected_grad, FP32_TOL)
