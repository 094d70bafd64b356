"""The monolithic loss written once in PyTorch: one shared softmax for every child, chunked over tokens.

Pass 1 (per chunk of `spec.chunk_tokens` tokens): upcast to fp32, transform the logits, and compute
the per-token statistics (lse, new_logp, entropy; teacher lse and the KL for distillation). Then the
eager middle (`coefficients.tail`: each child's coefficients, losses, metrics) sees every token.
Pass 2 (per chunk): recompute the softmax and write the gradient with respect to the raw logits,

    dL/dx_tj = prob_coeff_t * p_tj - label_coeff_t * [j == y_t] + teacher term + x_coeff_t * p_tj * x_tj,

times the chain rule of logit scaling/softcap, stored in the logits dtype.

With a teacher (the distillation child: q = softmax(teacher/T)) pass 1 also computes the teacher's
log-partition and the KL per token, and pass 2 adds the child's teacher term (children/distillation.py).

Tensor parallelism (vocab-parallel head, `group` given): the logits (and teacher logits) hold this
rank's vocab shard, labels are global ids. Each chunk all-reduces the max (MAX), then the sums
(sum-exp, sum exp*x, label logit, teacher sum-exp, KL cross term: SUM), so every rank sees global
statistics and writes the gradient of its own shard.

The per-chunk kernels run under `torch.compile(dynamic=True)` when `FASTLM_COMPILE` is "1", or by
default ("auto") when the logits are on CUDA; "0" forces eager. `FASTLM_COMPILE_BACKEND` picks the
backend (default inductor). A compile failure falls back to eager
with a warning.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from fastlm.losses.coefficients import tail
from fastlm.losses.spec import (
    LossNormalizers,
    LossResult,
    LossSpec,
    LossTargets,
    ProcessGroup,
    assemble_result,
    transform_logits,
)
from fastlm.losses.validation import check_inputs, raise_on_bad_values, value_flags, vocab_shard

COMPILE_ENV = "FASTLM_COMPILE"
BACKEND_ENV = "FASTLM_COMPILE_BACKEND"  # torch.compile backend, default inductor ("aot_eager" compiles fast)


def compile_wanted(device: torch.device) -> bool:
    """FASTLM_COMPILE: "1" always, "0" never, "auto" (default) on CUDA only (CPU compiles are slow)."""
    setting = os.environ.get(COMPILE_ENV, "auto").lower()
    if setting not in ("auto", "0", "1"):
        raise ValueError(f"{COMPILE_ENV} must be auto, 0 or 1, got {setting!r}")
    return setting == "1" or (setting == "auto" and device.type == "cuda")


class MaybeCompiled:
    """An eager function plus its lazily built `torch.compile` twin; falls back to eager on failure."""

    def __init__(self, function: Callable[..., torch.Tensor]) -> None:
        self.eager = function
        self._compiled: dict[str, Callable[..., torch.Tensor]] = {}
        self._failed = False

    def __call__(self, *args: object) -> torch.Tensor:
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        if self._failed or not compile_wanted(device):
            return self.eager(*args)
        backend = os.environ.get(BACKEND_ENV, "inductor")
        if backend not in self._compiled:
            self._compiled[backend] = torch.compile(self.eager, dynamic=True, backend=backend)
        try:
            return self._compiled[backend](*args)
        except Exception as error:  # noqa: BLE001 - any backend failure means "run eager"
            warnings.warn(f"torch.compile of {self.eager.__name__} failed ({error!r}); running eager", stacklevel=2)
            self._failed = True
            return self.eager(*args)


def _upcast(tensor: torch.Tensor) -> torch.Tensor:
    """fp32 math for 16-bit and fp32 inputs; float64 stays float64 (tests, debugging)."""
    return tensor if tensor.dtype == torch.float64 else tensor.float()


def _chunk_max(
    z: torch.Tensor, teacher: torch.Tensor | None, scale: float, softcap: float | None, inv_temperature: float
) -> torch.Tensor:
    """(T, 1 or 2): local max of x (and of teacher/T), the first all-reduce."""
    x = transform_logits(_upcast(z), scale, softcap)
    if teacher is None:
        return x.amax(-1, keepdim=True)
    return torch.stack([x.amax(-1), (_upcast(teacher) * inv_temperature).amax(-1)], dim=-1)


def _chunk_sums(
    z: torch.Tensor,
    teacher: torch.Tensor | None,
    maxima: torch.Tensor,
    local_label: torch.Tensor,
    scale: float,
    softcap: float | None,
    inv_temperature: float,
    reverse: bool,
    student_inv_temperature: float,
) -> torch.Tensor:
    """(T, 3 or 6) additive sums under the global max: sum e, sum e*x, label logit[, sum e_q, KL cross
    term, sum e_s]; e_s = exp((x - max) / T_s) is the student's softmax in the KL (T_s = T with
    temperature_mode both, else 1: then e_s = e)."""
    x = transform_logits(_upcast(z), scale, softcap)
    e = torch.exp(x - maxima[:, :1])
    hit = torch.arange(x.shape[-1], device=x.device) == local_label[:, None]
    label_x = torch.where(hit, x, torch.zeros_like(x)).sum(-1)
    sums = [e.sum(-1), (e * x).sum(-1), label_x]
    if teacher is not None:
        u = _upcast(teacher) * inv_temperature
        e_q = torch.exp(u - maxima[:, 1:])
        tempered = student_inv_temperature != 1.0
        x_s = x * student_inv_temperature if tempered else x
        e_s = torch.exp((x - maxima[:, :1]) * student_inv_temperature) if tempered else e
        # reverse: sum_j p_j (x_j - u_j) * sum e_s; forward: sum_j q_j (u_j - x_j) * sum e_q
        cross = (e_s * (x_s - u)).sum(-1) if reverse else (e_q * (u - x_s)).sum(-1)
        sums += [e_q.sum(-1), cross, e_s.sum(-1)]
    return torch.stack(sums, dim=-1)


def _chunk_grad(
    z: torch.Tensor,
    teacher: torch.Tensor | None,
    local_label: torch.Tensor,
    lse: torch.Tensor,
    prob_coeff: torch.Tensor,
    label_coeff: torch.Tensor,
    teacher_lse: torch.Tensor,
    teacher_coeff: torch.Tensor,
    x_coeff: torch.Tensor | None,
    student_lse: torch.Tensor,
    teacher_gap: torch.Tensor,
    scale: float,
    softcap: float | None,
    inv_temperature: float,
    reverse: bool,
    student_inv_temperature: float,
) -> torch.Tensor:
    """Gradient of the total loss wrt the raw logits z of one chunk, in z's dtype (the coefficient
    form of children/base.py; the teacher term is -k*q_j, or k*p_j*(x_j - u_j) for reverse KL, with
    their p_j part in prob_coeff; with a tempered student the whole term, k*(p_T,j - q_j) or
    k*p_T,j*((x_j/T - u_j) - E_pT[x/T - u]), from its own softmax `student_lse`)."""
    x = transform_logits(_upcast(z), scale, softcap)
    p = torch.exp(x - lse[:, None])
    hit = torch.arange(x.shape[-1], device=x.device) == local_label[:, None]
    grad = prob_coeff[:, None] * p - torch.where(hit, label_coeff[:, None], torch.zeros_like(p))
    if teacher is not None:
        u = _upcast(teacher) * inv_temperature
        if student_inv_temperature != 1.0:
            x_s = x * student_inv_temperature
            p_s = torch.exp(x_s - student_lse[:, None])
            if reverse:
                grad = grad + teacher_coeff[:, None] * p_s * (x_s - u - teacher_gap[:, None])
            else:
                grad = grad + teacher_coeff[:, None] * (p_s - torch.exp(u - teacher_lse[:, None]))
        elif reverse:
            grad = grad + teacher_coeff[:, None] * p * (x - u)
        else:
            grad = grad - teacher_coeff[:, None] * torch.exp(u - teacher_lse[:, None])
    if x_coeff is not None:
        grad = grad + x_coeff[:, None] * p * x
    if softcap is not None:
        grad = grad * (scale * (1.0 - (x / softcap).square()))
    elif scale != 1.0:
        grad = grad * scale
    return grad.to(z.dtype)


chunk_max = MaybeCompiled(_chunk_max)
chunk_sums = MaybeCompiled(_chunk_sums)
chunk_grad = MaybeCompiled(_chunk_grad)


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: ProcessGroup | None) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def compiled_loss(
    logits: torch.Tensor,
    targets: LossTargets,
    normalizers: LossNormalizers,
    spec: LossSpec,
    *,
    grad_scale: float = 1.0,
    group: ProcessGroup | None = None,
    compute_grad: bool = True,
) -> tuple[LossResult, torch.Tensor | None]:
    """Every child on one shared softmax; returns the detached result and d(loss*grad_scale)/d(logits).
    The value checks are read back last, after everything is enqueued (validation.py)."""
    check_inputs(logits, targets, normalizers, spec, group)
    mask, counts = value_flags(logits, targets, spec, group)
    with torch.no_grad():
        out = _compiled_loss(logits.detach(), targets, normalizers, spec, mask, grad_scale, group, compute_grad)
    raise_on_bad_values(counts, logits, targets, normalizers, spec, group)
    return out


def _compiled_loss(
    logits: torch.Tensor,
    targets: LossTargets,
    normalizers: LossNormalizers,
    spec: LossSpec,
    mask: torch.Tensor,
    grad_scale: float,
    group: ProcessGroup | None,
    compute_grad: bool,
) -> tuple[LossResult, torch.Tensor | None]:
    offset, _ = vocab_shard(logits, group)
    local_label = torch.where(mask, targets.labels - offset, -1)
    local_label = torch.where((local_label >= 0) & (local_label < logits.shape[-1]), local_label, -1)
    distill = spec.teacher
    teacher = targets.teacher_logits if distill is not None else None
    inv_t = 1.0 / distill.temperature if distill is not None else 1.0
    reverse = distill is not None and distill.reverse
    inv_s = distill.student_inv_temperature if distill is not None else 1.0
    numbers = (spec.logit_scale, spec.softcap, inv_t)
    chunks = [slice(start, start + spec.chunk_tokens) for start in range(0, logits.shape[0], spec.chunk_tokens)]

    stats = []
    for rows in chunks:
        chunk_teacher = None if teacher is None else teacher[rows]
        maxima = _all_reduce(chunk_max(logits[rows], chunk_teacher, *numbers), dist.ReduceOp.MAX, group)
        sums = chunk_sums(logits[rows], chunk_teacher, maxima, local_label[rows], *numbers, reverse, inv_s)
        stats.append(torch.cat([maxima, _all_reduce(sums, dist.ReduceOp.SUM, group)], dim=-1))
    # columns: max[, teacher max], sum e, sum e*x, label logit[, sum e_q, KL cross term, sum e_s]
    table = torch.cat(stats) if stats else logits.new_zeros((0, 4 if teacher is None else 8), dtype=torch.promote_types(logits.dtype, torch.float32))
    sums = table[:, 1:] if teacher is None else table[:, 2:]
    lse = table[:, 0] + torch.log(sums[:, 0])
    token_stats = {"lse": lse, "new_logp": sums[:, 2] - lse, "entropy": lse - sums[:, 1] / sums[:, 0]}
    teacher_lse, student_lse = lse, lse
    if teacher is not None:
        teacher_lse = table[:, 1] + torch.log(sums[:, 3])
        student_lse = table[:, 0] * inv_s + torch.log(sums[:, 5])  # of x / T_s
        token_stats.update(distill.token_stats(student_lse, teacher_lse, sums[:, 4], sums[:, 5], sums[:, 3]))
    out = tail(token_stats, mask, targets, normalizers, spec, grad_scale)
    result = assemble_result(spec, out.losses, out.metrics)
    if not compute_grad:
        return result, None

    grad = torch.empty_like(logits)
    grad_teacher = teacher if out.teacher is not None else None
    teacher_coeff = out.teacher if out.teacher is not None else out.prob
    for rows in chunks:
        grad[rows] = chunk_grad(
            logits[rows],
            None if grad_teacher is None else grad_teacher[rows],
            local_label[rows],
            lse[rows],
            out.prob[rows],
            out.label[rows],
            teacher_lse[rows],
            teacher_coeff[rows],
            None if out.x is None else out.x[rows],
            student_lse[rows],
            token_stats.get("teacher_gap", lse)[rows],
            *numbers,
            reverse,
            inv_s,
        )
    return result, grad
