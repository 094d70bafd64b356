"""Input checks shared by every loss implementation: bad tensors fail loudly, never as a silent NaN.

Each check names the offending tensor and says what was expected. Two stages, so the one
device->host synchronisation a call needs comes last and host and device work overlap:

- `check_inputs` (before any launch): shapes, dtypes, presence and the normaliser's sign; host only;
- the value checks (labels in range, any token unmasked, old_logp / advantages finite on unmasked
  tokens) are a small device tensor of counts, `[labels out of range, unmasked tokens]` plus
  `[non-finite old_logp, non-finite advantages]` with a policy child: `value_flags` builds it with
  torch ops, the fused Triton kernel writes the same counts itself. The implementation enqueues its
  whole computation, then `raise_on_bad_values` reads the counts once at the very end and raises the
  named error (the detailed message, with its extra syncs, is built only on failure). Kernels are
  memory-safe for any label value and for NaN policy inputs; what they produce then is discarded.

Zero syncs would leave out-of-range labels to a device-side assert (which poisons the CUDA context
and names no tensor) or to silent garbage, so we keep exactly one. An in-place gradient has already
overwritten the logits when the error is raised. Inside `deferred_value_checks()` the read moves to
the end of the block: one sync per block instead of one per call. The trainer goes further
(`collected_value_checks()`): it reads no count during the step, skips the weight update on the
device when `ValueCheck.fails()`, and reads the counts at its next read point (fastlm/engine/step_scalars.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fastlm.losses.spec import LossSpec
from fastlm.losses.tensors import IGNORE_INDEX, LossNormalizers, LossTargets, ProcessGroup, TeacherHead


def vocab_shard(logits: torch.Tensor, group: ProcessGroup | None) -> tuple[int, int]:
    """(first global vocab id of this rank's shard, global vocab size) of a vocab-parallel head.

    Shards are equal and laid out by rank, so rank r holds ids [r*V_local, (r+1)*V_local).
    """
    local = logits.shape[-1]
    if group is None:
        return 0, local
    return dist.get_rank(group) * local, dist.get_world_size(group) * local


POLICY_INPUTS = ("old_logp", "advantages")  # counted non-finite on unmasked tokens


def value_flag_count(spec: LossSpec) -> int:
    """Length of the value-check counts: labels out of range, unmasked tokens (+ one per policy input)."""
    return 2 + (len(POLICY_INPUTS) if spec.reads("old_logp") else 0)


def _raise_non_finite(name: str, tensor: torch.Tensor, mask: torch.Tensor) -> None:
    """Error path only: locate the first unmasked NaN/inf of `tensor` as float32, the precision the
    fast paths compute in (extra syncs are fine here)."""
    tensor = tensor.float()
    bad = ~torch.isfinite(tensor) & mask
    index = int(bad.nonzero()[0, 0])
    raise ValueError(
        f"targets.{name} has a non-finite value ({float(tensor[index])}) at unmasked token {index}; "
        f"{int(bad.sum())} unmasked tokens are NaN/inf"
    )


def check_inputs(
    logits: torch.Tensor,
    targets: LossTargets,
    normalizers: LossNormalizers,
    spec: LossSpec,
    group: ProcessGroup | None = None,
) -> None:
    """Host-only checks (no device op, no sync); raise `ValueError` naming the bad tensor or field."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be (tokens, vocab), got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor, got {logits.dtype}")
    tokens = logits.shape[0]
    labels = targets.labels
    if labels.shape != (tokens,):
        raise ValueError(
            f"targets.labels must have shape ({tokens},) to match logits {tuple(logits.shape)}, got {tuple(labels.shape)}"
        )
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets.labels must be int64 (or int32), got {labels.dtype}")
    if normalizers.tokens < 0:
        raise ValueError(f"normalizers.tokens must be > 0 when tokens are unmasked, got {normalizers.tokens}")
    for child in spec.children:
        child.check_targets(targets, tokens)
    _check_teacher(logits, targets, spec, group)


def value_flags(
    logits: torch.Tensor, targets: LossTargets, spec: LossSpec, group: ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask of unmasked tokens, the value-check counts) as device ops, no sync."""
    _, vocab = vocab_shard(logits, group)
    labels = targets.labels
    mask = labels != IGNORE_INDEX
    counts = [(mask & ((labels < 0) | (labels >= vocab))).sum(), mask.sum()]
    if spec.reads("old_logp"):
        counts += [(~torch.isfinite(getattr(targets, name).float()) & mask).sum() for name in POLICY_INPUTS]
    return mask, torch.stack(counts)


@dataclass
class ValueCheck:
    """One call's value-check counts (still on the device) and what naming a failure needs: the
    per-token inputs only, so a deferred check keeps no (tokens, vocab) tensor such as teacher logits alive."""

    counts: torch.Tensor
    vocab: int  # global vocabulary size
    labels: torch.Tensor
    old_logp: torch.Tensor | None
    advantages: torch.Tensor | None
    normalizers: LossNormalizers
    spec: LossSpec

    def fails(self) -> torch.Tensor:
        """A device bool, true when `raise_if_bad` will raise on these counts; no sync, so a caller that
        must not wait (the trainer's update, skipped on the device) can act on it before reading them."""
        bad_labels, tokens, *non_finite = self.counts.unbind()
        failed = bad_labels > 0
        for count in non_finite:
            failed = failed | (count > 0)
        return (failed | (tokens > 0)) if self._normalizers_fail() else failed

    def _normalizers_fail(self) -> bool:
        """Whether unmasked tokens make `raise_if_bad` refuse these normalizers (host values only)."""
        if self.normalizers.tokens == 0:
            return True
        try:
            for child in self.spec.children:
                child.check_normalizers(self.normalizers)
        except ValueError:
            return True
        return False

    def raise_if_bad(self, counts: list[float]) -> None:
        """Raise `ValueError` naming the first bad tensor or field, from the counts read back."""
        bad_labels, tokens, *non_finite = counts
        labels = self.labels
        if bad_labels:
            index = int(((labels != IGNORE_INDEX) & ((labels < 0) | (labels >= self.vocab))).nonzero()[0, 0])
            raise ValueError(
                f"targets.labels[{index}] = {int(labels[index])} is outside the vocabulary [0, {self.vocab}) "
                f"and is not the ignore index {IGNORE_INDEX}"
            )
        if tokens and self.normalizers.tokens == 0:
            raise ValueError(f"normalizers.tokens must be > 0 when tokens are unmasked, got {self.normalizers.tokens}")
        for name, bad in zip(POLICY_INPUTS, non_finite):
            if bad:
                _raise_non_finite(name, getattr(self, name), labels != IGNORE_INDEX)
        if tokens:
            for child in self.spec.children:
                child.check_normalizers(self.normalizers)


_PENDING: ContextVar[list[ValueCheck] | None] = ContextVar("fastlm_pending_value_checks", default=None)


def _value_check(
    counts: torch.Tensor, logits: torch.Tensor, targets: LossTargets, normalizers: LossNormalizers, spec: LossSpec,
    group: ProcessGroup | None,
) -> ValueCheck:
    return ValueCheck(counts, vocab_shard(logits, group)[1], targets.labels, targets.old_logp, targets.advantages,
                      normalizers, spec)


def raise_on_bad_values(
    counts: torch.Tensor,
    logits: torch.Tensor,
    targets: LossTargets,
    normalizers: LossNormalizers,
    spec: LossSpec,
    group: ProcessGroup | None = None,
) -> None:
    """The call's one device->host read of `counts` (from `value_flags` or the fused kernel), then the
    named `ValueError`; inside `deferred_value_checks()` the read waits for the block's end instead."""
    check = _value_check(counts, logits, targets, normalizers, spec, group)
    pending = _PENDING.get()
    if pending is None:
        check.raise_if_bad(counts.tolist())
    else:
        pending.append(check)


@contextmanager
def collected_value_checks() -> Iterator[list[ValueCheck]]:
    """Collect the value checks of every loss call in the block, unread: the caller reads their counts
    when it chooses (`raise_on_first_bad`), and meanwhile can act on `ValueCheck.fails()` on the device."""
    pending: list[ValueCheck] = []
    token = _PENDING.set(pending)
    try:
        yield pending
    finally:
        _PENDING.reset(token)


def check_counts(checks: list[ValueCheck]) -> list[torch.Tensor]:
    """The counts of `checks` as flat float tensors, to be read back together with other scalars."""
    return [check.counts.reshape(-1).float() for check in checks]


def raise_on_first_bad(checks: list[ValueCheck], values: list[float]) -> None:
    """Raise the first failure of `checks`, given their counts read back in one flat list."""
    start = 0
    for check in checks:
        size = check.counts.numel()
        check.raise_if_bad(values[start : start + size])
        start += size


@contextmanager
def deferred_value_checks() -> Iterator[None]:
    """Read the value checks of every loss call in the block back once, when it ends, and raise the
    first failure then: no host sync per call, so the host queues the next launch while the GPU works.
    Evaluation wraps its passes in it. Nothing is read if the block raises."""
    with collected_value_checks() as pending:
        yield
    if pending:
        raise_on_first_bad(pending, torch.cat(check_counts(pending)).tolist())


class _HostCopy:
    """A device tensor's copy into pinned host memory, started when made and read once its event has passed:
    the read waits for the kernels that wrote the tensor, not for everything queued after them."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.event: torch.cuda.Event | None = None
        self.values = tensor
        if tensor.is_cuda:
            self.values = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.values.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def read(self) -> list[float]:
        if self.event is not None:
            self.event.synchronize()
        return self.values.tolist()


@contextmanager
def checked_from_targets(
    counts: torch.Tensor,
    logits: torch.Tensor,
    targets: LossTargets,
    normalizers: LossNormalizers,
    spec: LossSpec,
    group: ProcessGroup | None = None,
) -> Iterator[None]:
    """A call whose value checks are counted from its targets before its work (the chunked head's):
    the counts start their copy to the host before the block and are read when it ends, so the read
    waits only for the kernels that counted them. Read at the end of the call's work, it drained the
    GPU, which then idled while the host queued the next call (~3.7 ms of a 43 ms head call on the
    H100). The loss calls inside the block count the same values on their rows: not read. Inside
    `collected_value_checks()` the call's check joins that block's; nothing is read if the block raises."""
    check = _value_check(counts, logits, targets, normalizers, spec, group)
    pending = _PENDING.get()
    copy = None if pending is not None else _HostCopy(counts)
    if pending is not None:
        pending.append(check)
    with collected_value_checks():
        yield
    if copy is not None:
        check.raise_if_bad(copy.read())


def check_teacher_head(teacher: TeacherHead, tokens: int, vocab: int, group: ProcessGroup | None) -> None:
    """Host checks of the teacher's hidden states (tokens, Ht) and head weight (vocab rows, Ht)."""
    hidden, weight = teacher.hidden, teacher.weight
    if hidden.ndim != 2 or hidden.shape[0] != tokens:
        raise ValueError(f"targets.teacher_head.hidden must be (tokens={tokens}, teacher hidden size), got {tuple(hidden.shape)}")
    shard = " shard" if group is not None else ""
    if weight.ndim != 2 or weight.shape != (vocab, hidden.shape[1]):
        raise ValueError(
            f"targets.teacher_head.weight must be (vocab{shard}={vocab}, teacher hidden size={hidden.shape[1]}), "
            f"got {tuple(weight.shape)}: the teacher must share the student's vocab"
        )
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise ValueError(f"targets.teacher_head must hold float tensors, got {hidden.dtype} and {weight.dtype}")
    if hidden.device != weight.device:
        raise ValueError(f"targets.teacher_head: hidden is on {hidden.device} but weight on {weight.device}")


def _check_teacher(logits: torch.Tensor, targets: LossTargets, spec: LossSpec, group: ProcessGroup | None) -> None:
    if spec.teacher is None:
        return
    if spec.teacher.top_k is not None and group is not None:
        raise ValueError(f"distillation loss '{spec.teacher.name}': top_k needs the teacher's whole row, which a "
                         "vocab-parallel head shards; set top_k: null or run without tensor parallelism")
    teacher = targets.teacher_logits
    if teacher.shape != logits.shape:
        raise ValueError(
            f"targets.teacher_logits must have the student's shape {tuple(logits.shape)} "
            f"(same tokens, same vocab{' shard' if group is not None else ''}), got {tuple(teacher.shape)}"
        )
    if not teacher.is_floating_point():
        raise ValueError(f"targets.teacher_logits must be a float tensor, got {teacher.dtype}")
