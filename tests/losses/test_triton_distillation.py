"""Distillation inside the fused Triton kernel: prefetch, temperature, teacher dtypes, half precision,
GSPO with a teacher, weight 0, masked rows, bad teachers, tensor parallelism (the mixes against
float64 and the compiled path are rows of test_matrix.py).

Without CUDA the kernel runs on Triton's CPU interpreter (conftest sets TRITON_INTERPRET=1), so shapes
stay tiny; `max_block=16` forces the looped multi-block path with a tail at vocab 37. Inputs come
from loss_cases.make_case: fresh random logits and teacher logits, ~30% labels at -100 (their
old_logp is NaN, so a masked token that is read shows up), packed documents for GSPO.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch.distributed as dist
from loss_cases import make_case, make_spec, reference_with_grad

from fastlm.losses.dispatch import monolithic_loss
from fastlm.losses.spec import LossNormalizers, LossResult, LossSpec, LossTargets
from fastlm.losses.triton import triton_loss
from tests.distributed.dist_helpers import spawn_ranks

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP32_TOL = 2e-6  # observed ~1e-8..4e-7 against float64
# Student and teacher logits rounded to 16 bits before the loss; the gradient is stored in 16 bits.
HALF_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
BLOCKS = {"single": 32768, "looped": 16}


def _case(kinds: str, seed: int, dtype: torch.dtype = torch.float32, teacher_dtype: torch.dtype | None = None,
          tokens: int = 24, vocab: int = 37, **numbers: float) -> tuple[LossSpec, torch.Tensor, LossTargets, LossNormalizers]:
    spec = make_spec(kinds, **numbers)
    logits, targets, normalizers = make_case(seed, tokens=tokens, vocab=vocab, dtype=dtype, spec=spec)
    teacher = targets.teacher_logits.to(teacher_dtype or dtype)
    targets = LossTargets(*(t.to(DEVICE) for t in (targets.labels, targets.old_logp, targets.advantages,
                                                   targets.document_ids)), teacher.to(DEVICE))
    return spec, logits.to(DEVICE), targets, normalizers


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    return float((actual - expected).norm() / expected.norm().clamp(min=1e-12))


def _check(label: str, result: LossResult, grad: torch.Tensor, expected: LossResult, expected_grad: torch.Tensor,
           tol: float) -> dict[str, float]:
    """Every child's loss, the total and the gradient within `tol` (relative); prints the errors."""
    errors = {name: _rel(result.losses[name], value) for name, value in expected.losses.items()}
    errors.update(total=_rel(result.loss, expected.loss), grad=_rel(grad, expected_grad))
    print(f"{label}: relative errors " + ", ".join(f"{k}={v:.2e}" for k, v in errors.items()))
    assert set(result.losses) == set(expected.losses)
    assert torch.isfinite(grad).all()
    assert max(errors.values()) < tol, errors
    return errors


@pytest.mark.parametrize("prefetch", [False, True], ids=["plain-loop", "prefetch"])
@pytest.mark.parametrize("kinds", ["ce+kd", "ce+z+kd_rev", "ce+kd_rev_both"])
def test_prefetch_distillation(prefetch: bool, kinds: str) -> None:
    """Distillation prefetches by default: either loop matches the reference, and the two agree (bit
    for bit on the interpreter, within 1e-6 compiled: multiply-add contraction may differ)."""
    spec, logits, targets, normalizers = _case(kinds, seed=12, tokens=16, softcap=3.0)
    result, grad = triton_loss(logits, targets, normalizers, spec, max_block=16, prefetch=prefetch)
    _, other = triton_loss(logits, targets, normalizers, spec, max_block=16, prefetch=not prefetch)
    assert _rel(grad, other) <= (0.0 if DEVICE.type == "cpu" else 1e-6)
    expected, expected_grad = reference_with_grad(logits, targets, normalizers, spec)
    _check(f"{kinds} prefetch={prefetch}", result, grad, expected, expected_grad, FP32_TOL)


@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("kinds", ["ce+kd", "ce+z+kd_rev", "ce+kd_rev_both", "ce+grpo+kd_rev"])
def test_split_rows(split: int, kinds: str) -> None:
    """`split` programs share a row (vocab 37 in 16-wide blocks: 3 blocks, so split 4 leaves one program
    an empty segment), merge their stats (on the GPU inside one launch, on the interpreter in two) and
    write their own segment's gradient: every child and the gradient match float64, in place too, with
    masked rows and a softcap."""
    spec, logits, targets, normalizers = _case(kinds, seed=14, tokens=16, softcap=3.0)
    result, grad = triton_loss(logits, targets, normalizers, spec, max_block=16, split=split)
    expected, expected_grad = reference_with_grad(logits, targets, normalizers, spec)
    _check(f"{kinds} split={split}", result, grad, expected, expected_grad, FP32_TOL)
    _, in_place = triton_loss(logits.clone(), targets, normalizers, spec, max_block=16, split=split, inplace=True)
    torch.testing.assert_close(in_place, grad, rtol=0, atol=0)
    assert torch.count_nonzero(grad[targets.labels == -100]) == 0


@pytest.mark.parametrize(("vocab", "split"), [(32000, 1), (131077, 2), (200003, 4)])
def test_default_schedule_of_long_rows(vocab: int, split: int) -> None:
    """No tuning given: with distillation a row longer than SPLIT_SEGMENT_COLUMNS is split into segments
    of about that size in 16384-column blocks on 8 warps (131077: 9 blocks, the tail one short; 200003:
    13 blocks, the last segment one block), a shorter one stays whole at 4096/4; float64 agreement."""
    from fastlm.losses.triton.launcher import Schedule, schedule

    assert schedule(vocab, distillation=True) == (
        Schedule(4096, 4, True, 1) if split == 1 else Schedule(16384, 8, True, split))
    assert schedule(vocab, distillation=False).split == 1
    spec, logits, targets, normalizers = _case("ce+z+kd", seed=15, tokens=4, vocab=vocab)
    result, grad = triton_loss(logits, targets, normalizers, spec)
    expected, expected_grad = reference_with_grad(logits, targets, normalizers, spec)
    _check(f"ce+z+kd V={vocab} default schedule", result, grad, expected, expected_grad, FP32_TOL)
    assert torch.count_nonzero(grad[targets.labels == -100]) == 0


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("tempered_student", [False, True], ids=["teacher", "both"])
def test_temperature(temperature: float, reverse: bool, tempered_student: bool) -> None:
    """temperature_mode teacher (only the teacher divided by T) and both (the student too, loss times
    T^2; T=1 is plain distillation); plain logits (no scale, no softcap), looped blocks."""
    spec, logits, targets, normalizers = _case("ce+kd_rev" if reverse else "ce+kd", seed=int(temperature * 10))
    child = replace(spec.teacher, temperature=temperature, tempered_student=tempered_student)
    spec = replace(spec, children=(spec.children[0], child))
    result, grad = triton_loss(logits, targets, normalizers, spec, max_block=16)
    expected, expected_grad = reference_with_grad(logits, targets, normalizers, spec)
    _check(f"T={temperature} reverse={reverse} both={tempered_student}", result, grad, expected, expected_grad, FP32_TOL)


@pytest.mark.parametrize("teacher_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block", list(BLOCKS))
def test_teacher_dtypes(teacher_dtype: torch.dtype, block: str) -> None:
    """fp32 student with a 16-bit teacher: the teacher is upcast in-kernel, so fp32 accuracy holds
    against a reference that sees the same rounded teacher values."""
    spec, logits, targets, normalizers = _case("ce+kd_rev", seed=5, teacher_dtype=teacher_dtype)
    result, grad = triton_loss(logits, targets, normalizers, spec, max_block=BLOCKS[block])
    expected, expected_grad = reference_with_grad(logits, targets, normalizers, spec)
    _check(f"teacher {teacher_dtype} {block}", result, grad, expected, expected_grad, FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kinds", ["ce+z+kd", "ce+kd_rev", "ce+kd_rev_both", "ce+kd_jsd_both"])
def test_half_precision_student_and_teacher(dtype: torch.dtype, kinds: str) -> None:
    """16-bit student and teacher, looped: the gradient comes back in the logits dtype."""
    spec, logits, targets, normalizers = _case(kinds, seed=6, dtype=dtype)
    result, grad = triton_loss(logits, targets, normalizers, spec, max_block=16)
    assert grad.dtype == dtype
    expected, expected_grad = reference_with_grad(logits, targets, normalizers, spec)
    _check(f"{kinds} {dtype}", result, grad, expected, expected_grad, HALF_TOL[dtype])


@pytest.mark.parametrize("kinds", ["gspo+kd", "z+gspo_len+kd_rev", "gspo+kd_jsd_both"])
@pytest.mark.parametrize("block", list(BLOCKS))
def test_gspo_with_distillation_uses_stats_and_grad_launches(kinds: str, block: str) -> None:
    """GSPO forces fused launch (no gradient) -> seam -> grad launch; the teacher stats ride along."""
    spec, logits, targets, normalizers = _case(kinds, seed=8, tokens=32, softcap=4.0)
    result, grad = triton_loss(logits, targets, normalizers, spec, grad_scale=0.5, max_block=BLOCKS[block])
    expected, expected_grad = reference_with_grad(logits, targets, normalizers, spec, grad_scale=0.5)
    _check(f"{kinds} {block}", result, grad, expected, expected_grad, FP32_TOL)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("tempered_student", [False, True], ids=["teacher", "both"])
def test_weight_zero_distillation_logs_loss_without_gradient(reverse: bool, tempered_student: bool) -> None:
    spec, logits, targets, normalizers = _case("ce+kd_rev" if reverse else "ce+kd", seed=9)
    spec = replace(spec, children=(spec.children[0], replace(spec.teacher, weight=0.0, tempered_student=tempered_student)))
    result, grad = triton_loss(logits, targets, normalizers, spec, max_block=16)
    _, ce_grad = triton_loss(logits, targets, normalizers, LossSpec(spec.children[:1]), max_block=16)
    expected, _ = reference_with_grad(logits, targets, normalizers, spec)
    print(f"weight 0 reverse={reverse}: grad rel to CE-only {_rel(grad, ce_grad):.2e}, "
          f"kd rel {_rel(result.losses['kd'], expected.losses['kd']):.2e}")
    # A different build of the same label math: the tempered variant's compile for sm_90 contracts other
    # multiply-adds (H200: 1.1e-7; the interpreter and the teacher-only variant: < 1e-7), so 1 ulp more.
    assert _rel(grad, ce_grad) < (2e-7 if tempered_student else 1e-7)
    assert float(result.losses["kd"]) > 0.0 and _rel(result.losses["kd"], expected.losses["kd"]) < FP32_TOL


def test_masked_rows_zero_gradient_all_masked_finite_inplace() -> None:
    """Masked rows get exactly zero gradient; an all-masked batch gives 0, not NaN; in place is exact."""
    spec, logits, targets, normalizers = _case("ce+kd_rev", seed=10, dtype=torch.bfloat16)
    _, grad = triton_loss(logits, targets, normalizers, spec, max_block=16)
    assert torch.count_nonzero(grad[targets.labels == -100]) == 0
    buffer = logits.clone()
    _, in_place = triton_loss(buffer, targets, normalizers, spec, max_block=16, inplace=True)
    assert in_place.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(in_place, grad, rtol=0, atol=0)
    all_masked = replace(targets, labels=torch.full_like(targets.labels, -100))
    result, zero_grad = triton_loss(logits, all_masked, LossNormalizers(0.0, 0.0), spec, max_block=16)
    assert float(result.loss) == 0.0 and float(result.losses["kd"]) == 0.0
    assert torch.count_nonzero(zero_grad) == 0


def test_through_dispatch_and_autograd() -> None:
    spec, logits, targets, normalizers = _case("ce+z+kd", seed=12, softcap=3.0)
    leaf = logits.clone().requires_grad_()
    result = monolithic_loss(leaf, targets, normalizers, spec, "triton")
    (result.loss * 0.5).backward()
    expected, expected_grad = reference_with_grad(logits, targets, normalizers, spec, grad_scale=0.5)
    _check("dispatch ce+z+kd", result, leaf.grad, expected, expected_grad, FP32_TOL)


def test_bad_teacher_is_named() -> None:
    spec, logits, targets, normalizers = _case("ce+kd", seed=13)
    with pytest.raises(ValueError, match="targets.teacher_logits must be float32, float16 or bfloat16"):
        triton_loss(logits, replace(targets, teacher_logits=targets.teacher_logits.double()), normalizers, spec)
    strided = targets.teacher_logits.t().contiguous().t()
    with pytest.raises(ValueError, match=r"targets.teacher_logits must be contiguous along the vocab dim"):
        triton_loss(logits, replace(targets, teacher_logits=strided), normalizers, spec)
    with pytest.raises(ValueError, match="targets.teacher_logits is required"):
        triton_loss(logits, replace(targets, teacher_logits=None), normalizers, spec)
    with pytest.raises(ValueError, match="num_warps"):
        triton_loss(logits, targets, normalizers, spec, num_warps=3)
    with pytest.raises(ValueError, match="split must be a power of two"):
        triton_loss(logits, targets, normalizers, spec, split=3)


TP_MIXES = {"ce+z+kd": {"softcap": 3.0}, "ce+grpo+kd_rev": {"logit_scale": 0.8}, "gspo+kd_rev": {}, "gspo+kd_both": {},
            "ce+kd_jsd_both": {"softcap": 3.0}}  # the generalized JSD: its vocab pass's sums all-reduced too


def _tp_worker(rank: int, world: int, folder: str) -> None:
    """One rank of a vocab-parallel head: its shard of student and teacher logits, global labels."""
    saved = {}
    for kinds, numbers in TP_MIXES.items():
        spec, logits, targets, normalizers = _case(kinds, seed=21, tokens=32, vocab=38, **numbers)
        shard = slice(rank * 19, (rank + 1) * 19)
        local = replace(targets, teacher_logits=targets.teacher_logits[:, shard].contiguous())
        result, grad = triton_loss(logits[:, shard].contiguous(), local, normalizers, spec,
                                   group=dist.group.WORLD, max_block=16)
        saved[kinds] = (result.loss, result.losses, result.metrics, grad)
    torch.save(saved, os.path.join(folder, f"rank{rank}.pt"))


def test_tensor_parallel_two_ranks(tmp_path: os.PathLike) -> None:
    """gloo, world size 2: each rank holds 19 of 38 vocab ids (looped blocks of 16 with a tail); the
    teacher's max, sum-exp and cross sum are all-reduced with the student's (and the JSD pass's sums)."""
    world = 2
    spawn_ranks(_tp_worker, str(tmp_path), world=world)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for kinds, numbers in TP_MIXES.items():
        spec, logits, targets, normalizers = _case(kinds, seed=21, tokens=32, vocab=38, **numbers)
        expected, expected_grad = reference_with_grad(logits, targets, normalizers, spec)
        grad = torch.cat([saved[kinds][3] for saved in ranks], dim=1)
        for rank, saved in enumerate(ranks):
            _check(f"TP {kinds} rank {rank}", LossResult(*saved[kinds][:3]), grad, expected, expected_grad, FP32_TOL)
