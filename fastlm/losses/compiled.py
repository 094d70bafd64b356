"""The monolithic loss written once in PyTorch: one shared softmax for every child, chunked over tokens.

Pass 1 (per chunk of `spec.chunk_tokens` tokens): upcast to fp32, transform the logits, and compute
the per-token statistics (lse, new_logp, entropy; teacher lse and the KL for distillation). Then the
eager middle (`coefficients.tail`: each child's coefficients, losses, metrics) sees every token.
Pass 2 (per chunk): recompute the softmax and write the gradient with respect to the raw logits,

    dL/dx_tj = prob_coeff_t * p_tj - label_coeff_t * [j == y_t] + teacher term + x_coeff_t * p_tj * x_tj,

times the chain rule of logit scaling/softcap, stored in the logits dtype.

With a teacher (the distillation child: q = softmax(teacher/T)) pass 1 also computes the teacher's
log-partition and the KL per token, and pass 2 adds the child's teacher term (children/distillation.py).

The three steps are public phases (`compiled_stats`, `compiled_finish`, `compiled_grad`; `LossPhases`
in function.py): `compiled_loss` runs them on one call, the chunked head (chunked_head.py) runs the first
and last per token chunk and the middle once on the whole call when a per-document child needs it.

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

import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from fastlm.losses.coefficients import tail
from fastlm.losses.spec import LossSpec, assemble_result
from fastlm.losses.tensors import IGNORE_INDEX, LossNormalizers, LossResult, LossTargets, ProcessGroup, transform_logits
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
    jsd_beta: float,
    extra: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gradient of the total loss wrt the raw logits z of one chunk, in z's dtype (the coefficient
    form of children/base.py; the teacher term is -k*q_j, or k*p_j*(x_j - u_j) for reverse KL, with
    their p_j part in prob_coeff; with a tempered student the whole term, k*(p_T,j - q_j) or
    k*p_T,j*((x_j/T - u_j) - E_pT[x/T - u]), from its own softmax `student_lse`; the generalized JSD
    (0 < `jsd_beta` < 1, else 0) k*p_T,j*(l_j - KL(p_T || M)), l = log p_T - log M, KL in `teacher_gap`);
    `extra`: a teacher term computed outside (the teacher's top-k support, `_topk_terms`), per element of x."""
    x = transform_logits(_upcast(z), scale, softcap)
    p = torch.exp(x - lse[:, None])
    hit = torch.arange(x.shape[-1], device=x.device) == local_label[:, None]
    grad = prob_coeff[:, None] * p - torch.where(hit, label_coeff[:, None], torch.zeros_like(p))
    if teacher is not None:
        u = _upcast(teacher) * inv_temperature
        if jsd_beta:
            x_s = x * student_inv_temperature
            log_p, _, log_m = _log_mixture(x_s, student_lse, u, teacher_lse, jsd_beta)
            grad = grad + teacher_coeff[:, None] * log_p.exp() * (log_p - log_m - teacher_gap[:, None])
        elif student_inv_temperature != 1.0:
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
    if extra is not None:
        grad = grad + extra
    if x_coeff is not None:
        grad = grad + x_coeff[:, None] * p * x
    if softcap is not None:
        grad = grad * (scale * (1.0 - (x / softcap).square()))
    elif scale != 1.0:
        grad = grad * scale
    return grad.to(z.dtype)


def _log_mixture(
    x_s: torch.Tensor, student_lse: torch.Tensor, u: torch.Tensor, teacher_lse: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log p_s, log q, log M) of the generalized JSD, M = beta*q + (1-beta)*p_s."""
    log_p = x_s - student_lse[:, None]
    log_q = u - teacher_lse[:, None]
    return log_p, log_q, torch.logaddexp(log_p + math.log1p(-beta), log_q + math.log(beta))


def _chunk_jsd(
    z: torch.Tensor,
    teacher: torch.Tensor,
    student_lse: torch.Tensor,
    teacher_lse: torch.Tensor,
    scale: float,
    softcap: float | None,
    inv_temperature: float,
    student_inv_temperature: float,
    beta: float,
) -> torch.Tensor:
    """(T, 2) additive sums of the generalized JSD once the log-partitions are known: its value
    beta*KL(q || M) + (1-beta)*KL(p_s || M) and KL(p_s || M) (the gradient's mean term)."""
    x_s = transform_logits(_upcast(z), scale, softcap) * student_inv_temperature
    log_p, log_q, log_m = _log_mixture(x_s, student_lse, _upcast(teacher) * inv_temperature, teacher_lse, beta)
    student_kl = (log_p.exp() * (log_p - log_m)).sum(-1)
    teacher_kl = (log_q.exp() * (log_q - log_m)).sum(-1)
    return torch.stack([beta * teacher_kl + (1.0 - beta) * student_kl, student_kl], dim=-1)


def _topk_terms(
    z: torch.Tensor, teacher: torch.Tensor, scale: float, softcap: float | None, inv_temperature: float,
    student_inv_temperature: float, top_k: int, reverse: bool, beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The divergence over the teacher's top-k support S, both renormalised over S (children/distillation.py):
    (S's column indices (T, k), the divergence per token (T,), its gradient wrt y_S = x_S * T_s^-1 (T, k)),
    in closed form: forward p_S - q_S; reverse p_S (l - KL), l = log p_S - log q_S; the generalized JSD
    (1 - beta) p_S (l - KL(p_S || M)), l = log p_S - log M."""
    u = _upcast(teacher) * inv_temperature
    support = u.topk(min(top_k, u.shape[-1]), dim=-1).indices
    y = transform_logits(_upcast(z), scale, softcap).gather(-1, support) * student_inv_temperature
    log_p, log_q = torch.log_softmax(y, dim=-1), torch.log_softmax(u.gather(-1, support), dim=-1)
    p = log_p.exp()
    if beta:
        _, _, log_m = _log_mixture(y, torch.logsumexp(y, dim=-1), u.gather(-1, support),
                                   torch.logsumexp(u.gather(-1, support), dim=-1), beta)
        student_kl = (p * (log_p - log_m)).sum(-1)
        value = beta * (log_q.exp() * (log_q - log_m)).sum(-1) + (1.0 - beta) * student_kl
        return support, value, (1.0 - beta) * p * (log_p - log_m - student_kl[:, None])
    if reverse:
        value = (p * (log_p - log_q)).sum(-1)
        return support, value, p * (log_p - log_q - value[:, None])
    q = log_q.exp()
    return support, (q * (log_q - log_p)).sum(-1), p - q


chunk_max = MaybeCompiled(_chunk_max)
chunk_sums = MaybeCompiled(_chunk_sums)
chunk_grad = MaybeCompiled(_chunk_grad)
chunk_jsd = MaybeCompiled(_chunk_jsd)


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
    inplace: bool = False,
) -> tuple[LossResult, torch.Tensor | None]:
    """Every child on one shared softmax; returns the detached result and d(loss*grad_scale)/d(logits)
    (`inplace`: written over `logits`). The value checks are read back last, after everything is
    enqueued (validation.py)."""
    check_inputs(logits, targets, normalizers, spec, group)
    with torch.no_grad():
        logits = logits.detach()
        stats = compiled_stats(logits, targets, normalizers, spec, group=group)
        result, coefficients, counts = compiled_finish([stats], logits, targets, normalizers, spec,
                                                       grad_scale=grad_scale, group=group)
        grad = None
        if compute_grad:
            grad = logits if inplace else torch.empty_like(logits)
            compiled_grad(logits, targets, normalizers, spec, coefficients, grad, group=group)
    raise_on_bad_values(counts, logits, targets, normalizers, spec, group)
    return result, grad


# The compiled path in three phases (`compiled_loss` runs them on one call; the chunked head runs the
# first and the last per token chunk, the middle once on the whole call: chunked_head.py).


def _teacher_numbers(spec: LossSpec) -> tuple[float, bool, float, float]:
    """(1/T of the teacher, reverse KL, 1/T of the student, the generalized JSD's beta or 0) of the
    distillation child (neutral without one)."""
    distill = spec.teacher
    if distill is None:
        return 1.0, False, 1.0, 0.0
    return 1.0 / distill.temperature, distill.reverse, distill.student_inv_temperature, distill.jsd_beta or 0.0


def _top_k(spec: LossSpec) -> int | None:
    """The distillation child's top-k support (None: the whole vocab, or no teacher)."""
    return None if spec.teacher is None else spec.teacher.top_k


def _local_labels(logits: torch.Tensor, targets: LossTargets, group: ProcessGroup | None) -> torch.Tensor:
    """Labels as column indices of this rank's vocab shard; -1 where masked or in another shard."""
    offset, _ = vocab_shard(logits, group)
    local = torch.where(targets.labels != IGNORE_INDEX, targets.labels - offset, -1)
    return torch.where((local >= 0) & (local < logits.shape[-1]), local, -1)


def _sub_chunks(tokens: int, spec: LossSpec) -> list[slice]:
    return [slice(start, start + spec.chunk_tokens) for start in range(0, tokens, spec.chunk_tokens)]


def compiled_stats(
    logits: torch.Tensor, targets: LossTargets, normalizers: LossNormalizers, spec: LossSpec, *,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """Pass 1: the (tokens, 4, 8 or 10) statistics table (all-reduced under `group`), columns max[, teacher
    max], sum e, sum e*x, label logit[, sum e_q, KL cross term, sum e_s[, JSD, KL(p_s || M)]]; the
    generalized JSD's columns come from a second vocab pass per sub-chunk (they need the log-partitions);
    with the teacher's top-k support, (tokens, 5): the student's columns and the divergence over it."""
    local_label = _local_labels(logits, targets, group)
    teacher = targets.teacher_logits if spec.teacher is not None else None
    inv_t, reverse, inv_s, beta = _teacher_numbers(spec)
    numbers = (spec.logit_scale, spec.softcap, inv_t)
    top_k = _top_k(spec)
    stats = []
    for rows in _sub_chunks(logits.shape[0], spec):
        chunk_teacher = None if teacher is None else teacher[rows]
        if top_k is not None:  # no tensor parallelism (validation): the student's sums and the top-k divergence
            maxima = chunk_max(logits[rows], None, *numbers)
            sums = chunk_sums(logits[rows], None, maxima, local_label[rows], *numbers, reverse, inv_s)
            _, value, _ = _topk_terms(logits[rows], chunk_teacher, *numbers, inv_s, top_k, reverse, beta)
            stats.append(torch.cat([maxima, sums, value[:, None].to(sums.dtype)], dim=-1))
            continue
        maxima = _all_reduce(chunk_max(logits[rows], chunk_teacher, *numbers), dist.ReduceOp.MAX, group)
        sums = chunk_sums(logits[rows], chunk_teacher, maxima, local_label[rows], *numbers, reverse, inv_s)
        columns = [maxima, _all_reduce(sums, dist.ReduceOp.SUM, group)]
        if beta:
            teacher_lse, student_lse = _log_partitions(columns[0], columns[1][:, 3:], inv_s)
            jsd = chunk_jsd(logits[rows], chunk_teacher, student_lse, teacher_lse, *numbers, inv_s, beta)
            columns.append(_all_reduce(jsd, dist.ReduceOp.SUM, group))
        stats.append(torch.cat(columns, dim=-1))
    columns = 4 if teacher is None else 5 if top_k is not None else 10 if beta else 8
    return torch.cat(stats) if stats else logits.new_zeros((0, columns), dtype=torch.promote_types(logits.dtype, torch.float32))


def _log_partitions(maxima: torch.Tensor, teacher_sums: torch.Tensor, inv_s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(teacher lse of u, student lse of x / T_s) from the maxima columns and the sums [sum e_q, cross, sum e_s]."""
    return maxima[:, 1] + torch.log(teacher_sums[:, 0]), maxima[:, 0] * inv_s + torch.log(teacher_sums[:, 2])


@dataclass(frozen=True)
class CompiledCoefficients:
    """What pass 2 reads per token: the log-partitions and the children's coefficients (`tail`)."""

    lse: torch.Tensor
    prob: torch.Tensor
    label: torch.Tensor
    teacher_lse: torch.Tensor
    teacher: torch.Tensor  # the teacher term's coefficient (the prob one when no child sets it)
    x: torch.Tensor | None
    student_lse: torch.Tensor
    teacher_gap: torch.Tensor
    teacher_term: bool  # a distillation child writes gradient (weight != 0)

    def rows(self, rows: slice) -> CompiledCoefficients:
        return replace(self, **{name: getattr(self, name)[rows] for name in
                                ("lse", "prob", "label", "teacher_lse", "teacher", "student_lse", "teacher_gap")},
                       x=None if self.x is None else self.x[rows])


def compiled_finish(
    tables: list[torch.Tensor], logits: torch.Tensor, targets: LossTargets, normalizers: LossNormalizers,
    spec: LossSpec, *, grad_scale: float = 1.0, group: ProcessGroup | None = None,
) -> tuple[LossResult, CompiledCoefficients, torch.Tensor]:
    """The middle on every token of the call (`tables`: pass 1 of its chunks, in order; `logits`: any
    of them, for the vocab): each child's losses, metrics and coefficients, and the value-check counts."""
    mask, counts = value_flags(logits, targets, spec, group)
    table = torch.cat(tables)
    distill = spec.teacher
    teacher = distill is not None
    _, _, inv_s, beta = _teacher_numbers(spec)
    top_k = _top_k(spec)
    sums = table[:, 2:] if teacher and top_k is None else table[:, 1:]
    lse = table[:, 0] + torch.log(sums[:, 0])
    token_stats = {"lse": lse, "new_logp": sums[:, 2] - lse, "entropy": lse - sums[:, 1] / sums[:, 0]}
    teacher_lse, student_lse = lse, lse
    if top_k is not None:  # the divergence over the teacher's top-k support
        token_stats["teacher_kl"] = sums[:, 3]
    elif teacher:
        teacher_lse, student_lse = _log_partitions(table, sums[:, 3:], inv_s)
        if beta:  # the JSD pass's columns: the loss per token and KL(p_s || M)
            token_stats.update({"teacher_kl": sums[:, 6], "teacher_gap": sums[:, 7]})
        else:
            token_stats.update(distill.token_stats(student_lse, teacher_lse, sums[:, 4], sums[:, 5], sums[:, 3]))
    out = tail(token_stats, mask, targets, normalizers, spec, grad_scale)
    coefficients = CompiledCoefficients(
        lse, out.prob, out.label, teacher_lse, out.teacher if out.teacher is not None else out.prob, out.x,
        student_lse, token_stats.get("teacher_gap", lse), out.teacher is not None,
    )
    return assemble_result(spec, out.losses, out.metrics), coefficients, counts


def compiled_grad(
    logits: torch.Tensor, targets: LossTargets, normalizers: LossNormalizers, spec: LossSpec,
    coefficients: CompiledCoefficients, grad: torch.Tensor, *, group: ProcessGroup | None = None,
) -> None:
    """Pass 2: the gradient wrt the raw logits into `grad` (which may be `logits`: each sub-chunk is
    read before it is written). `coefficients` are this call's (or chunk's) rows, grad_scale included."""
    local_label = _local_labels(logits, targets, group)
    teacher = targets.teacher_logits if coefficients.teacher_term else None
    inv_t, reverse, inv_s, beta = _teacher_numbers(spec)
    numbers = (spec.logit_scale, spec.softcap, inv_t)
    c = coefficients
    top_k = _top_k(spec)
    for rows in _sub_chunks(logits.shape[0], spec):
        chunk_teacher, extra = None if teacher is None else teacher[rows], None
        if top_k is not None and chunk_teacher is not None:  # the top-k term, scattered on its support
            support, _, term = _topk_terms(logits[rows], chunk_teacher, *numbers, inv_s, top_k, reverse, beta)
            extra = torch.zeros(logits[rows].shape, dtype=term.dtype, device=term.device)
            extra.scatter_(-1, support, c.teacher[rows, None].to(term.dtype) * term)
            chunk_teacher = None
        grad[rows] = chunk_grad(
            logits[rows], chunk_teacher, local_label[rows], c.lse[rows], c.prob[rows],
            c.label[rows], c.teacher_lse[rows], c.teacher[rows], None if c.x is None else c.x[rows],
            c.student_lse[rows], c.teacher_gap[rows], *numbers, reverse, inv_s, beta, extra,
        )
