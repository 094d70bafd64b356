"""Launch the fused loss kernel: the three modes, the TP all-reduce.

- no tensor parallelism, no per-document child: one fused forward+backward launch (every child's
  coefficients in-kernel);
- tensor parallelism (`group`), or a child the fused kernel has no slot for (`interface.fused` false:
  no `slot`, e.g. a call-wide entropy quantile, the bias-corrected KL, a token-mean entropy weight
  apart from the loss_type's; or no per-token function in terms.py): stats launch, all-reduce of the
  mergeable pieces (student and teacher; none without a group), with the generalized JSD (0 < beta < 1)
  its vocab pass from the merged log-partitions (`jsd_sums_kernel`, its sums all-reduced too), every
  child's tail in torch (`coefficients.tail`), grad launch;
- a per-document child (GSPO) without tensor parallelism: the fused launch without the gradient
  (which also writes the per-token state), that child's seam launch on the term buffer (the
  sync-free seam: its loss and document metrics rows, its coefficients added to the state), then the
  row sums and the grad launch.
The last two are three phases (`_stats_phase` and `_grad_launch`, public as `triton_stats` and
`triton_grad`, around `triton_finish`) so the chunked head (losses/chunked_head.py) can run
the stats and grad phases per token chunk and the middle once on the whole call.
Every argument that depends on the children comes from interface.py (the children's slots as data,
cached per spec), so nothing here branches on a kind. The fused launch writes every per-token
loss/metric term into one buffer laid out by `interface.FusedLayout` (the same keys as the children's
tails), so its whole tail is one row-sum launch (`row_sums_kernel`); `spec.assemble_result` builds
the result of every mode.

Validation: host checks before any launch; the value checks (validation.py) are counted on the device
(by the fused kernel itself, else (tensor parallel) by `value_flags`) and read back once, after
everything is enqueued, so the host never waits for the GPU before the end of the call (inside
`validation.deferred_value_checks()`, not before the end of that block).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.distributed as dist
import triton

from fastlm.losses.coefficients import tail
from fastlm.losses.spec import LossSpec, assemble_result
from fastlm.losses.tensors import LossNormalizers, LossResult, LossTargets, ProcessGroup, safe_inverse
from fastlm.losses.triton.interface import (
    FusedLayout,
    LaunchConfig,
    Rows,
    fused_result,
    interface,
    launch_constexprs,
    params_on,
    stats_rows,
    teacher_grad_stats,
)
from fastlm.losses.triton.kernel import (
    MODE_FUSED,
    MODE_GRAD,
    MODE_STATS,
    N_PIECES,
    SPLIT_EXCHANGE,
    SPLIT_PUBLISH,
    SPLIT_READ,
    jsd_sums_kernel,
    lm_loss_kernel,
    row_sums_kernel,
)
from fastlm.losses.validation import check_inputs, raise_on_bad_values, value_flags, vocab_shard

MAX_BLOCK = 32768
JSD_BLOCK = 4096  # the generalized JSD's vocab pass (`_jsd_sums`): columns per step, untuned (no GPU sweep yet)
# With distillation a row longer than this many columns is split (`default_split`) into segments of
# about this size, one program each, walked in 16384-column blocks on 8 warps: the fastest of the H100
# sweeps in tuning-log entry 19 (CE+kd's kernel alone, 2048 rows: 0.796 -> 0.615 ms at V=131072,
# 1.595 -> 1.207 at 262144, 0.921 -> 0.773 at 152064); shorter rows stay whole at 4096/4.
SPLIT_SEGMENT_COLUMNS = 65536
ROW_SUM_BLOCK, ROW_SUM_WARPS = 8192, 16  # the term-sum launch: columns per step, warps (run 5: the fastest of 3)
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _block_size(vocab: int, max_block: int) -> int:
    if max_block < 16 or max_block & (max_block - 1) or max_block > MAX_BLOCK:
        raise ValueError(f"max_block must be a power of two in [16, {MAX_BLOCK}], got {max_block}")
    return min(triton.next_power_of_2(vocab), max_block)


def default_max_block(vocab: int, distillation: bool = False) -> int:
    """Label-based children: a quarter of the row per block, 16384 at most (8192 at V=32000, 16384 at
    V=131072: the fastest points of the H200 sweep, docs/tuning-log.md entry 12); a row of at most
    4096 columns is one block. With distillation (two live rows per block) 4096, and 16384 for a row
    long enough to be split (entry 19)."""
    if distillation:
        return 16384 if vocab > SPLIT_SEGMENT_COLUMNS else 4096
    if vocab <= 4096:
        return triton.next_power_of_2(vocab)
    return min(16384, triton.next_power_of_2(triton.cdiv(vocab, 4)))


def default_num_warps(block: int, distillation: bool = False) -> int:
    """One warp per 1024 columns, at least 4 (8192/8, 16384/16): 2-3% faster than half the warps for CE
    and CE+z+GRPO in the H200 sweeps of runs 4, 6 and 7 (entry 14). With distillation (two live rows
    per block) one per 2048 (4096/4, 16384/8: 8 warps 10% faster than 16 at 16384, entry 19)."""
    return min(32, max(4, block // (2048 if distillation else 1024)))


def default_prefetch(distillation: bool = False) -> bool:
    """Looped rows load the next vocab block before the current block's math: with distillation (two
    16-bit blocks per step) 7-9% faster on the H200 at 4096/4, every swept shape; the label-based
    kernel is not faster with it (docs/tuning-log.md entry 17)."""
    return distillation


def default_split(vocab: int, block: int, distillation: bool = False) -> int:
    """Programs per row of the fused launch. With distillation a row of student + teacher (512 KiB at
    V=131072 in bf16) is too long for its second read to hit L2 when each program holds a whole row:
    a row longer than SPLIT_SEGMENT_COLUMNS goes to a power of two of programs, each owning about that
    many columns (2 at V=131072 and 152064, 4 at 262144), at most one per block."""
    if not distillation or vocab <= SPLIT_SEGMENT_COLUMNS:
        return 1
    segments = 1 << (triton.cdiv(vocab, SPLIT_SEGMENT_COLUMNS).bit_length() - 1)
    return min(segments, 1 << (triton.cdiv(vocab, block).bit_length() - 1))


class Schedule(NamedTuple):
    """How the fused launch walks a row: columns per block, warps, the next block's loads ahead or not,
    programs per row."""

    block: int
    num_warps: int
    prefetch: bool
    split: int


def schedule(vocab: int, distillation: bool, max_block: int | None = None, num_warps: int | None = None,
             prefetch: bool | None = None, split: int | None = None) -> Schedule:
    """The launch's schedule for rows of `vocab` columns: each value given (tuning, tests) or its default
    (`default_max_block`, `default_num_warps`, `default_prefetch`, `default_split`); a row of one block
    is never split (nothing to share)."""
    block = _block_size(vocab, default_max_block(vocab, distillation) if max_block is None else max_block)
    split = default_split(vocab, block, distillation) if split is None else split
    return Schedule(
        block,
        default_num_warps(block, distillation) if num_warps is None else num_warps,
        default_prefetch(distillation) if prefetch is None else prefetch,
        1 if vocab <= block else split,
    )


def _check_supported(logits: torch.Tensor, targets: LossTargets, spec: LossSpec, num_warps: int | None,
                     split: int | None = None) -> None:
    """What this kernel cannot run, named; the shared checks live in validation.py."""
    if not spec.children:
        raise ValueError("the loss spec has no children; nothing for the Triton kernel to compute")
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be a power of two in [1, 32], got {num_warps}")
    if split is not None and split not in (1, 2, 4, 8, 16, 32, 64):
        raise ValueError(f"split must be a power of two in [1, 64], got {split}")
    if not spec.logit_scale > 0 or (spec.softcap is not None and not spec.softcap > 0):
        # The kernel divides by the softcap; both are positive in every config (losses/config.py).
        raise ValueError(f"logit_scale and softcap must be > 0, got {spec.logit_scale} and {spec.softcap}")
    if logits.dtype not in KERNEL_DTYPES:
        raise ValueError(f"logits must be float32, float16 or bfloat16 for the Triton kernel, got {logits.dtype}")
    for name, tensor in (("labels", targets.labels), ("old_logp", targets.old_logp), ("advantages", targets.advantages),
                         ("teacher_logits", targets.teacher_logits)):
        if tensor is not None and tensor.device != logits.device:
            raise ValueError(f"targets.{name} is on {tensor.device} but logits are on {logits.device}")
    if logits.ndim == 2 and logits.stride(1) != 1:
        raise ValueError(f"logits must be contiguous along the vocab dim (stride 1), got strides {logits.stride()}")
    teacher = targets.teacher_logits
    if spec.teacher is not None and teacher is not None and teacher.ndim == 2:
        if teacher.dtype not in KERNEL_DTYPES:
            raise ValueError(
                f"targets.teacher_logits must be float32, float16 or bfloat16 for the Triton kernel, got {teacher.dtype}"
            )
        if teacher.stride(1) != 1:
            raise ValueError(
                f"targets.teacher_logits must be contiguous along the vocab dim (stride 1), got strides {teacher.stride()}"
            )


class _Launch:
    """The arguments every launch shares for one call; `run` fills in the mode-specific ones."""

    def __init__(
        self,
        logits: torch.Tensor,
        targets: LossTargets,
        normalizers: LossNormalizers,
        spec: LossSpec,
        vocab_start: int,
        max_block: int | None,
        num_warps: int | None,
        prefetch: bool | None,
        split: int | None = None,
    ):
        self.logits = logits
        self.labels = targets.labels.contiguous()
        self.targets = targets
        self.normalizers = normalizers
        self.spec = spec
        self.interface = interface(spec)
        self.teacher = targets.teacher_logits if spec.teacher is not None else None
        self.vocab_start = vocab_start
        self.block, self.num_warps, self.prefetch, self.split = schedule(
            logits.shape[1], spec.teacher is not None, max_block, num_warps, prefetch, split)
        # On the GPU a split row's programs exchange their stats inside one launch; the interpreter runs
        # programs one after another (a program that waited would wait forever), so it launches twice.
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # (tools/profile/kernel_report.py: CPU tensors, compiled)
        self.split_phases = (SPLIT_PUBLISH.value, SPLIT_READ.value) if interpreted else (SPLIT_EXCHANGE.value,)

    def rows(self, count: int) -> torch.Tensor:
        """A (count, tokens) fp32 per-token buffer."""
        return torch.empty((count, self.logits.shape[0]), dtype=torch.float32, device=self.logits.device)

    def _inputs(self, fused: bool) -> tuple[torch.Tensor, ...]:
        """old_logp, advantages, ref_logp and the slots' per-token weights w_t as the FUSED launch reads
        them (fp32, contiguous); the logits where a launch reads nothing."""
        rows = self.interface.fused_rows
        read = {"old_logp": rows.policy_inputs, "advantages": rows.policy_inputs, "ref_logp": rows.ref_input} if fused else {}
        inputs = [getattr(self.targets, name).float().contiguous() if read.get(name) else self.logits
                  for name in ("old_logp", "advantages", "ref_logp")]
        weights = [child.call_weights(self.targets, self.normalizers) if kind == "token_weights"
                   else child.call_entropy_weights(self.targets, self.normalizers)
                   for child, kind in self.interface.weight_rows] if fused else []
        if not weights:
            return (*inputs, self.logits)
        return (*inputs, weights[0].contiguous() if len(weights) == 1 else torch.stack(weights))

    def run(self, mode: int, rows: torch.Tensor, layout: Rows, grad: torch.Tensor | None, token_scale: float = 0.0,
            grad_scale: float = 1.0) -> None:
        """One launch of `mode` on the per-token `rows` laid out by `layout`; `token_scale` (1/tokens) makes
        the in-kernel coefficients (FUSED) and the distillation one (GRAD)."""
        fused = mode == MODE_FUSED.value
        teacher = self.teacher if self.teacher is not None else self.logits
        tokens = self.logits.shape[0]
        split = self.split if fused else 1
        phases, pieces, sync = (SPLIT_EXCHANGE.value,), self.logits, self.logits  # (never read unsplit)
        if split > 1:
            phases = self.split_phases
            pieces = torch.empty(tokens * split * N_PIECES.value, dtype=torch.float32, device=self.logits.device)
            if phases == (SPLIT_EXCHANGE.value,):
                sync = torch.zeros(tokens + 1, dtype=torch.int32, device=self.logits.device)
        inputs = self._inputs(fused)
        params = params_on(self.spec, self.logits.device)
        constexprs = launch_constexprs(self.spec, mode, grad is not None)
        acc = min(self.block, 32 * self.num_warps * (16 // self.logits.element_size()))
        single_pass = self.logits.shape[1] <= self.block
        for phase in phases:  # one launch, or publish then read (the interpreter)
            lm_loss_kernel[(tokens * split,)](
                self.logits,
                self.logits.stride(0),
                grad if grad is not None else self.logits,
                grad.stride(0) if grad is not None else 0,
                self.labels,
                teacher,
                teacher.stride(0),
                self.logits.shape[1],
                self.vocab_start,
                float(self.spec.logit_scale),
                float(self.spec.softcap) if self.spec.softcap is not None else 1.0,
                self.interface.inv_temperature,
                rows,
                rows.stride(0),
                params,
                float(token_scale),
                float(grad_scale),
                *inputs,
                pieces,
                sync,
                LAUNCH=LaunchConfig(mode, grad is not None, self.spec.softcap is not None, self.block, acc, split, phase,
                                    single_pass, self.prefetch and not single_pass),
                LAYOUT=layout,
                **constexprs,
                num_warps=self.num_warps,
                enable_fp_fusion=True,  # the fused multiply-adds the kernel is costed with; Triton 3.10 turns the default off
            )


def _fused_terms(launch: _Launch, grad: torch.Tensor | None, grad_scale: float) -> tuple[torch.Tensor, FusedLayout]:
    """One launch: stats, in-kernel coefficients, the gradient (unless None) and the (K, T) per-token
    term buffer."""
    found = launch.interface
    terms = launch.rows(found.layout.rows)
    launch.run(MODE_FUSED.value, terms, found.fused_rows, grad, safe_inverse(launch.normalizers.tokens), grad_scale)
    return terms, found.layout


def _reduce_fused(
    terms: torch.Tensor, layout: FusedLayout
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """`fused_result` of the term buffer: the token sums of its first `layout.summed` rows in one launch."""
    totals = torch.empty(layout.summed, dtype=torch.float32, device=terms.device)
    block = min(ROW_SUM_BLOCK, triton.next_power_of_2(max(terms.shape[1], 1)))
    row_sums_kernel[(layout.summed,)](terms, totals, terms.shape[1], BLOCK=block, num_warps=ROW_SUM_WARPS)
    return fused_result(totals, layout)


@dataclass(frozen=True)
class GradCoefficients:
    """What the grad launch reads per token: the fp32 rows of `values` named by `layout` (the log-partition,
    both coefficients, the entropy-bonus one when `layout.x_term`, the teacher's `teacher_grad_stats`);
    unscaled: the launch applies `grad_scale`."""

    values: torch.Tensor  # (R, T)
    layout: Rows
    grad_scale: float

    def rows(self, rows: slice) -> GradCoefficients:
        """The coefficients of one token chunk (a view)."""
        return replace(self, values=self.values[:, rows])


def _grad_launch(launch: _Launch, coefficients: GradCoefficients, grad: torch.Tensor) -> None:
    """The grad launch from per-token coefficients computed outside the kernel (the seam, or the torch tail)."""
    launch.run(MODE_GRAD.value, coefficients.values, coefficients.layout, grad,
               safe_inverse(launch.normalizers.tokens), coefficients.grad_scale)


# Two launches around a middle: a per-document child (the seam: the fused launch without the
# gradient, that child's seam launch on its term buffer) or tensor parallelism, or a child without a
# fused slot (stats launch, all-reduce under a group, every child's torch tail). `triton_loss` runs
# the phases on one call; the chunked head runs the stats and grad phases per token chunk and the
# middle once on the whole call (losses/chunked_head.py).


def _stats_phase(launch: _Launch, group: ProcessGroup | None) -> dict[str, torch.Tensor]:
    """Per-token state (tokens on the last dim): the fused launch's (K, T) term buffer without a group
    (no gradient, so no grad_scale), else the merged statistics of `_reduce_stats`."""
    if group is None and launch.interface.fused:
        return {"terms": _fused_terms(launch, None, 1.0)[0]}
    return _reduce_stats(launch, group)


def _seam_finish(
    terms: torch.Tensor, targets: LossTargets, normalizers: LossNormalizers, spec: LossSpec, grad_scale: float
) -> tuple[LossResult, GradCoefficients, torch.Tensor]:
    """The per-document children's tails on the fused launch's terms (their seams: their rows and
    coefficients, one launch each, sync-free), the terms reduced, and the grad launch's coefficients
    (the state rows)."""
    found = interface(spec)
    layout = found.layout
    for child, seam in found.seams:
        seam(child, terms, layout, targets, normalizers)
    losses, metrics, kernel_total, counts = _reduce_fused(terms, layout)
    coefficients = GradCoefficients(terms[layout.state:layout.rows], Rows.of(layout.state_names, x_term=found.x_term),
                                    grad_scale)
    return assemble_result(spec, losses, metrics, kernel_total), coefficients, counts


def _tp_finish(
    stats: dict[str, torch.Tensor], logits: torch.Tensor, targets: LossTargets, normalizers: LossNormalizers,
    spec: LossSpec, grad_scale: float, group: ProcessGroup | None,
) -> tuple[LossResult, GradCoefficients, torch.Tensor]:
    """Every child's tail on the merged statistics (tensor parallelism, or a child without a fused slot),
    and the grad launch's coefficients."""
    mask, counts = value_flags(logits, targets, spec, group)
    out = tail(stats, mask, targets, normalizers, spec)
    coefficients = {"lse": stats["lse"], "prob_coeff": out.prob, "label_coeff": out.label}
    if out.x is not None:
        coefficients["x_coeff"] = out.x
    if spec.teacher is not None:
        coefficients.update({name: stats[name] for name in teacher_grad_stats(spec.teacher.slot())})
    values = torch.stack([value.float() for value in coefficients.values()])
    layout = Rows.of(tuple(coefficients), x_term=out.x is not None)
    return assemble_result(spec, out.losses, out.metrics), GradCoefficients(values, layout, grad_scale), counts


def _reduce_stats(launch: _Launch, group: ProcessGroup | None) -> dict[str, torch.Tensor]:
    """Stats launch, then merge the shards' pieces over `group`: (max, sum-exp, label logit, shifted
    moment) of the student, (max, sum-exp, cross sum) of the teacher, and with a tempered student
    (temperature_mode both) its sum-exp at x/T, whose max is the student's over T. Returns the tail's
    statistics, with the teacher's and the tempered student's log-partitions."""
    distill = launch.spec.teacher
    names = stats_rows(launch.spec)
    pieces = launch.rows(len(names))
    launch.run(MODE_STATS.value, pieces, Rows.of(names), None)
    maxima, sums = pieces.split([names.index("sum_exp"), len(names) - names.index("sum_exp")])
    inv_t = 1.0 if distill is None else distill.student_inv_temperature
    if group is not None:
        sum_exp, label_logit, moment, *kd_sums = sums.unbind()  # teacher sum-exp[, tempered], cross
        local = maxima.clone()
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        shift = local - maxima
        rescale = torch.exp(shift)
        parts = [sum_exp * rescale[0], label_logit, rescale[0] * (moment + shift[0] * sum_exp)]
        if distill is not None:
            student = rescale[0] if inv_t == 1.0 else torch.exp(shift[0] * inv_t)  # under the KL student's max
            parts += [kd_sums[0] * rescale[1]] + [tempered * student for tempered in kd_sums[1:-1]]
            # The cross sum is weighted by the KL student's softmax terms (reverse) or the teacher's (forward).
            parts += [kd_sums[-1] * (student if distill.reverse else rescale[1])]
        sums = torch.stack(parts)
        dist.all_reduce(sums, group=group)
    log_sum = torch.log(sums[0])
    lse = maxima[0] + log_sum
    stats = {"lse": lse, "new_logp": sums[1] - lse, "entropy": log_sum - sums[2] / sums[0]}
    if distill is None:
        return stats
    tempered = inv_t != 1.0
    student_sum = sums[4] if tempered else sums[0]
    stats["student_lse"] = maxima[0] * inv_t + torch.log(student_sum) if tempered else lse
    stats["teacher_lse"] = maxima[1] + torch.log(sums[3])
    if distill.jsd_beta is not None:
        stats["teacher_kl"], stats["teacher_gap"] = _jsd_sums(launch, stats["student_lse"], stats["teacher_lse"], group)
    else:
        stats.update(distill.token_stats(stats["student_lse"], stats["teacher_lse"], sums[-1], student_sum, sums[3]))
    return stats


def _jsd_sums(launch: _Launch, student_lse: torch.Tensor, teacher_lse: torch.Tensor,
              group: ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The generalized JSD's vocab pass (`jsd_sums_kernel`) from the merged log-partitions, its two sums
    all-reduced over `group`: (the JSD per token, KL(p_s || M))."""
    distill = launch.spec.teacher
    rows = launch.rows(4)
    rows[0], rows[1] = student_lse, teacher_lse
    block = min(launch.block, JSD_BLOCK)  # whole-block temporaries (no lane folding): kept register-sized
    jsd_sums_kernel[(launch.logits.shape[0],)](
        launch.logits, launch.logits.stride(0), launch.teacher, launch.teacher.stride(0), launch.labels, rows,
        rows.stride(0), launch.logits.shape[1], float(launch.spec.logit_scale),
        float(launch.spec.softcap) if launch.spec.softcap is not None else 1.0, launch.interface.inv_temperature,
        float(distill.jsd_beta), HAS_SOFTCAP=launch.spec.softcap is not None,
        TEMPERED=distill.student_inv_temperature != 1.0, BLOCK=block, num_warps=default_num_warps(block, True),
    )
    sums = rows[2:]
    if group is not None:
        dist.all_reduce(sums, group=group)
    return sums[0], sums[1]


def triton_loss(
    logits: torch.Tensor,
    targets: LossTargets,
    normalizers: LossNormalizers,
    spec: LossSpec,
    *,
    grad_scale: float = 1.0,
    group: ProcessGroup | None = None,
    compute_grad: bool = True,
    inplace: bool = False,
    max_block: int | None = None,
    num_warps: int | None = None,
    prefetch: bool | None = None,
    split: int | None = None,
) -> tuple[LossResult, torch.Tensor | None]:
    """The monolithic loss and its gradient w.r.t. the raw logits (this rank's vocab shard under
    `group`). `inplace` overwrites `logits` with the gradient; `max_block` caps the vocab block
    (default `default_max_block(vocab)`), `num_warps` overrides the per-block default, `prefetch`
    loads each vocab block an iteration ahead (default `default_prefetch`) and `split` sets the fused
    launch's programs per row (default `default_split`); all four for tuning."""
    launch = _checked_launch(logits, targets, normalizers, spec, group, max_block, num_warps, prefetch, split)
    grad = None
    if compute_grad:
        grad = logits if inplace else torch.empty_like(logits, memory_format=torch.contiguous_format)
    if group is None and not spec.per_document and launch.interface.fused:
        losses, metrics, kernel_total, counts = _reduce_fused(*_fused_terms(launch, grad, grad_scale))
        result = assemble_result(spec, losses, metrics, kernel_total)
    else:
        state = _stats_phase(launch, group)
        result, coefficients, counts = triton_finish([state], logits, targets, normalizers, spec,
                                                     grad_scale=grad_scale, group=group)
        if grad is not None:
            _grad_launch(launch, coefficients, grad)
    raise_on_bad_values(counts, logits, targets, normalizers, spec, group)
    return result, grad


def _checked_launch(
    logits: torch.Tensor, targets: LossTargets, normalizers: LossNormalizers, spec: LossSpec,
    group: ProcessGroup | None, max_block: int | None = None, num_warps: int | None = None,
    prefetch: bool | None = None, split: int | None = None,
) -> _Launch:
    """The host checks (this kernel's, then the shared ones), then the call's launch arguments."""
    _check_supported(logits, targets, spec, num_warps, split)
    check_inputs(logits, targets, normalizers, spec, group)
    vocab_start, _ = vocab_shard(logits, group)
    return _Launch(logits, targets, normalizers, spec, vocab_start, max_block, num_warps, prefetch, split)


def triton_stats(
    logits: torch.Tensor, targets: LossTargets, normalizers: LossNormalizers, spec: LossSpec, *,
    group: ProcessGroup | None = None, **tuning: int | bool | None,
) -> dict[str, torch.Tensor]:
    """The stats phase of one token chunk (for `triton_finish`); `tuning`: max_block, num_warps, prefetch, split."""
    launch = _checked_launch(logits, targets, normalizers, spec, group, **tuning)
    return _stats_phase(launch, group)


def triton_finish(
    states: list[dict[str, torch.Tensor]], logits: torch.Tensor, targets: LossTargets,
    normalizers: LossNormalizers, spec: LossSpec, *, grad_scale: float = 1.0, group: ProcessGroup | None = None,
) -> tuple[LossResult, GradCoefficients, torch.Tensor]:
    """The middle once on the whole call: `states` are the stats phase of its chunks in token order
    (`targets` of every token; `logits`: any chunk, for the vocab). Returns the result, the grad launch's
    coefficients and the value-check counts (for `raise_on_bad_values`)."""
    merged = states[0] if len(states) == 1 else {name: torch.cat([state[name] for state in states], dim=-1)
                                                  for name in states[0]}
    if group is None and interface(spec).fused:
        return _seam_finish(merged["terms"], targets, normalizers, spec, grad_scale)
    return _tp_finish(merged, logits, targets, normalizers, spec, grad_scale, group)


def triton_grad(
    logits: torch.Tensor, targets: LossTargets, normalizers: LossNormalizers, spec: LossSpec,
    coefficients: GradCoefficients, grad: torch.Tensor, *, group: ProcessGroup | None = None,
    **tuning: int | bool | None,
) -> None:
    """The grad phase of one token chunk into `grad` (may be `logits`), from its rows of the coefficients."""
    launch = _checked_launch(logits, targets, normalizers, spec, group, **tuning)
    _grad_launch(launch, coefficients, grad)


def fused_kernel_only(
    logits: torch.Tensor,
    targets: LossTargets,
    normalizers: LossNormalizers,
    spec: LossSpec,
    grad: torch.Tensor,
    *,
    max_block: int | None = None,
    num_warps: int | None = None,
    prefetch: bool | None = None,
    split: int | None = None,
) -> torch.Tensor:
    """The single fused launch and nothing else (no validation, no reduction of the terms), for specs
    without GSPO: the benchmark times it next to `triton_loss` to split kernel time from host-side
    work. Returns the (K, T) per-token term buffer."""
    _check_supported(logits, targets, spec, num_warps, split)
    if not interface(spec).fused:
        raise ValueError("fused_kernel_only: a child of this spec has no fused slot (it runs its torch tail)")
    launch = _Launch(logits, targets, normalizers, spec, 0, max_block, num_warps, prefetch, split)
    terms, _ = _fused_terms(launch, grad, 1.0)
    return terms
