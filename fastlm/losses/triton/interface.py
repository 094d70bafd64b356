"""The fused kernel's interface as data: the children's slots -> the kernel's arguments, once per spec.

Each child declares its `KernelSlot` (children/base.py: its numbers, its term rows, its switches) and
holds no kernel code. This module turns a spec's slots into what `lm_loss_kernel` takes:

- `params`: one fp32 buffer, the head's numbers (kernel.HEAD_PARAMS) then each slot's `scalars`, copied
  to the device once per spec (`params_on`); the kernel reads them once per program;
- `FusedLayout`: the rows of the fused launch's (K, T) term buffer, generated from the slots' row names
  (each child's rows, the weighted total, the value-check counts, a per-document child's state);
- constexprs: each label-form child's slot as one flat namedtuple (SLOT0..SLOT3: its per-token function
  from terms.py as `terms`, `<row>_row` for each of its rows, the buffer offset of each number, each
  switch, `token_weights` and `entropy_weights`: its rows of the per-token weights, -1 for none), the
  teacher's (`Teacher`), and per launch `Rows`: the rows of the kernel's
  per-token buffer (the FUSED terms, the STATS pieces or the GRAD coefficients) and its per-token switches.

The namedtuples are flat on purpose: Triton 3.6 (the GPU image's) passes a namedtuple constexpr on to a
@triton.jit function only when its fields are plain values, not tuples.

A spec runs fused when every child has a slot, each label-form one with a function in terms.TERMS (a
per-document one with a seam in documents.SEAMS) and at most MAX_SLOTS of them, and no generalized JSD
(its mixture needs a vocab pass after the statistics, `jsd_sums_kernel`); otherwise the Triton path runs
the children's torch tail between a stats and a grad launch (launcher.py).
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

import torch

from fastlm.losses.children.base import KernelSlot, LossChild, metric_key
from fastlm.losses.spec import LossSpec
from fastlm.losses.triton.documents import SEAMS
from fastlm.losses.triton.kernel import MODE_FUSED, MODE_GRAD, MODE_STATS
from fastlm.losses.triton.terms import TERMS, no_terms
from fastlm.losses.validation import value_flag_count

SLOT_ARGUMENTS = ("SLOT0", "SLOT1", "SLOT2", "SLOT3")  # the kernel's constexprs of the label-form children
MAX_SLOTS = len(SLOT_ARGUMENTS)
# The per-token state a fused launch writes for a per-document child (unscaled, 0 on masked tokens): what
# its seam and the grad launch read (the seam adds its coefficients to the last three in place), then
# the teacher's grad stats.
STATE_ROWS = ("lse", "new_logp", "entropy", "prob_coeff", "label_coeff", "x_coeff")
# The value-check counts, in validation.value_flags' order (the policy inputs' two with a policy child).
FLAG_ROWS = ("bad_labels", "unmasked", "bad_old_logp", "bad_advantages")


class LaunchConfig(NamedTuple):
    """What one launch does and how it walks a row (kernel constexpr LAUNCH): its mode (kernel.MODE_*),
    whether it writes the gradient, whether the head has a softcap; columns per block, lanes of the
    running sums, programs per row, the split row's exchange phase, one block per row, the next block's
    loads ahead."""

    mode: int
    grad: bool
    softcap: bool
    block: int
    acc: int
    split: int
    split_phase: int
    single_pass: bool
    prefetch: bool


class Rows(NamedTuple):
    """The rows of the kernel's per-token (K, T) buffer in one launch (-1: not in it), by what they hold,
    and the launch's per-token switches (kernel constexpr LAYOUT)."""

    n_rows: int = 0
    # FUSED: the weighted total and the value-check counts (FLAG_ROWS)
    total: int = -1
    bad_labels: int = -1
    unmasked: int = -1
    bad_old_logp: int = -1
    bad_advantages: int = -1
    # FUSED with a per-document child: the state it writes (STATE_ROWS, teacher_grad_stats); GRAD: what it reads
    lse: int = -1
    new_logp: int = -1
    entropy: int = -1
    prob_coeff: int = -1
    label_coeff: int = -1
    x_coeff: int = -1
    teacher_lse: int = -1
    student_lse: int = -1
    teacher_gap: int = -1
    # STATS: the mergeable pieces (stats_rows)
    max: int = -1
    teacher_max: int = -1
    sum_exp: int = -1
    label_logit: int = -1
    moment: int = -1
    teacher_sum_exp: int = -1
    tempered_sum_exp: int = -1
    cross: int = -1
    # switches
    x_term: bool = False  # the gradient's p_j * x_j term (FUSED: a slot's entropy bonus; GRAD: x_coeff is read)
    reads_entropy: bool = False  # FUSED: a slot reads the entropy (the vocab pass keeps the moment sum)
    policy_inputs: bool = False  # FUSED: a slot reads old_logp and advantages
    ref_input: bool = False  # FUSED: a slot reads ref_logp

    @classmethod
    def named(cls, names: tuple[str, ...], first: int = 0) -> dict[str, int]:
        """Row indices of `names`, numbered from `first` in order."""
        return {name: first + index for index, name in enumerate(names)}

    @classmethod
    def of(cls, names: tuple[str, ...], **switches: bool) -> Rows:
        """A buffer holding `names` in order, and nothing else."""
        return cls(len(names), **cls.named(names), **switches)


class Teacher(NamedTuple):
    """The distillation slot (kernel constexpr TEACHER): its statistics and gradient term live in the vocab
    loop. `stats`/`grad`: this launch keeps the teacher's statistics / writes its gradient term; `weight`
    and `kd_scale` (and `beta` with `jsd`) are offsets into the parameter buffer (its 1/T is the kernel
    argument `inv_temperature`: the vocab loop multiplies every element by it); `loss_row` its term row
    (FUSED), else -1. `jsd`: the generalized JSD with 0 < beta < 1, whose mixture needs a vocab pass
    between the statistics and the gradient (`jsd_sums_kernel`), so it never runs FUSED."""

    present: bool = False
    stats: bool = False
    grad: bool = False
    reverse: bool = False
    tempered: bool = False
    jsd: bool = False
    loss_row: int = -1
    weight: int = 0
    kd_scale: int = 0
    beta: int = 0


@dataclass(frozen=True)
class FusedLayout:
    """Rows of the fused kernel's (K, T) per-token buffer: each child's rows from `starts[name]` (its slot's
    `rows`; a per-document child's loss and document rows come from its seam), then the weighted total
    of the kernel-finished children (not the per-document ones: `spec.assemble_result` adds them), all
    already divided by the step's token count (document metrics by the step's documents); rows `flags`
    to `summed` are the unscaled value-check counts (validation.value_flags order); with a per-document
    child, rows from `state` on are `state_names` (STATE_ROWS, then the teacher's grad stats)."""

    starts: dict[str, int]
    row_names: dict[str, tuple[str, ...]]  # child name -> its slot's row names
    total: int
    flags: int
    summed: int
    state: int
    rows: int
    keys: tuple[tuple[bool, str], ...]  # (is a loss, result key) of each row before `total`
    state_names: tuple[str, ...] = ()

    def row(self, child: str, name: str) -> int:
        """The row of one of a child's terms."""
        return self.starts[child] + self.row_names[child].index(name)

    def state_row(self, terms: torch.Tensor, name: str) -> torch.Tensor:
        """One per-token state vector (a contiguous view of `terms`)."""
        return terms[self.state + self.state_names.index(name)]


def teacher_grad_stats(slot: KernelSlot) -> tuple[str, ...]:
    """The per-token statistics the grad launch reads for the teacher (a tail's stats keys): its
    log-partition, and with a tempered student the student's at x/T and E_pT[x/T - u] (`teacher_gap`); with the
    generalized JSD the student's log-partition of its KL softmax and KL(p_s || M) (`teacher_gap`)."""
    if slot.switches["tempered"] or slot.switches["jsd"]:
        return ("teacher_lse", "student_lse", "teacher_gap")
    return ("teacher_lse",)


def stats_rows(spec: LossSpec) -> tuple[str, ...]:
    """The STATS launch's rows: the maxima first, then the sums (the order the tensor-parallel merge reads)."""
    if spec.teacher is None:
        return ("max", "sum_exp", "label_logit", "moment")
    tempered = ("tempered_sum_exp",) if spec.teacher.slot().switches["tempered"] else ()
    return ("max", "teacher_max", "sum_exp", "label_logit", "moment", "teacher_sum_exp", *tempered, "cross")


def _field(row: str) -> str:
    """A row name as a namedtuple field ('clip_ratio/low_mean' -> 'clip_ratio_low_mean_row')."""
    return row.replace("/", "_") + "_row"


@lru_cache(maxsize=64)
def _slot_type(fields: tuple[str, ...]) -> type:
    return namedtuple("Slot", fields)


NO_SLOT = _slot_type(("terms",))(no_terms)


@dataclass(frozen=True)
class Interface:
    """A spec's kernel arguments that are the same every call (`interface`)."""

    fused: bool  # the fused launch runs every child (else the torch tail between a stats and a grad launch)
    params: tuple[float, ...]
    inv_temperature: float  # the teacher's 1/T (1 without one)
    teacher: Teacher  # present/numbers; `stats`, `grad` and `loss_row` are set per launch (`launch_constexprs`)
    layout: FusedLayout | None = None  # fused only
    slots: tuple[Any, ...] = ()  # fused only: MAX_SLOTS flat namedtuples
    fused_rows: Rows | None = None  # fused only: the FUSED launch's LAYOUT
    # the fused launch's per-token weight rows in buffer order: (child, "token_weights" (its w_t) or
    # "entropy_weights" (its entropy bonus's v_t))
    weight_rows: tuple[tuple[LossChild, str], ...] = ()
    seams: tuple[tuple[LossChild, Any], ...] = ()  # (per-document child, its seam)
    x_term: bool = False  # a slot's gradient has the p_j * x_j term


def _runs_fused(spec: LossSpec, slots: dict[str, KernelSlot | None]) -> bool:
    labelled = [child for child in spec.children if not child.uses_teacher]
    jsd = spec.teacher is not None and slots[spec.teacher.name].switches["jsd"]
    return (not jsd and all(slot is not None for slot in slots.values()) and len(labelled) <= MAX_SLOTS
            and all(slots[child.name].kind in TERMS for child in labelled)
            and all(slots[child.name].kind in SEAMS for child in spec.per_document))


def _fused_layout(spec: LossSpec, slots: dict[str, KernelSlot]) -> FusedLayout:
    keys: list[tuple[bool, str]] = []
    starts: dict[str, int] = {}
    for child in spec.children:
        starts[child.name] = len(keys)
        keys.extend((True, child.name) if row == "loss" else (False, metric_key(child.name, row))
                    for row in slots[child.name].rows)
    total = len(keys)
    summed = total + 1 + value_flag_count(spec)
    state_names = ()
    if spec.per_document:
        state_names = STATE_ROWS + (teacher_grad_stats(slots[spec.teacher.name]) if spec.teacher else ())
    state = summed if state_names else -1
    return FusedLayout(starts, {child.name: slots[child.name].rows for child in spec.children}, total, total + 1,
                       summed, state, summed + len(state_names), tuple(keys), state_names)


@lru_cache(maxsize=256)
def interface(spec: LossSpec) -> Interface:
    """The spec's parameter buffer, teacher, and (when it runs fused) its layout and slot constexprs."""
    params: list[float] = []

    def offsets(scalars: dict[str, float]) -> dict[str, int]:
        found = {name: len(params) + index for index, name in enumerate(scalars)}
        params.extend(float(value) for value in scalars.values())
        return found

    slots = {child.name: child.slot() for child in spec.children}
    teacher, inv_temperature = Teacher(), 1.0
    if spec.teacher is not None:
        slot = slots[spec.teacher.name]
        numbers = dict(slot.scalars)
        inv_temperature = numbers.pop("inv_temperature")
        teacher = Teacher(True, **slot.switches, **offsets(numbers))
    if not _runs_fused(spec, slots):
        return Interface(False, tuple(params), inv_temperature, teacher)
    layout = _fused_layout(spec, slots)
    labelled = [child for child in spec.children if not child.uses_teacher]
    weight_rows = tuple((child, kind) for child in labelled for kind in ("token_weights", "entropy_weights")
                        if getattr(slots[child.name], kind))
    constexprs = []
    for child in labelled:
        slot = slots[child.name]
        fields = {"terms": TERMS[slot.kind], **{_field(row): layout.row(child.name, row) for row in slot.rows},
                  **offsets(slot.scalars), **slot.switches,
                  **{kind: weight_rows.index((child, kind)) if (child, kind) in weight_rows else -1
                     for kind in ("token_weights", "entropy_weights")}}
        constexprs.append(_slot_type(tuple(fields))(**fields))
    constexprs += [NO_SLOT] * (MAX_SLOTS - len(constexprs))
    used = [slots[child.name] for child in labelled]
    reads = {name for slot in used for name in slot.reads}
    x_term = any(slot.x_term for slot in used)
    flags = FLAG_ROWS[:layout.summed - layout.flags]
    fused_rows = Rows(layout.rows, total=layout.total, **Rows.named(flags, layout.flags),
                      **Rows.named(layout.state_names, layout.state), x_term=x_term,
                      reads_entropy=any(slot.entropy for slot in used),
                      policy_inputs="old_logp" in reads or "bad_old_logp" in flags,  # (counted like value_flags)
                      ref_input="ref_logp" in reads)
    if spec.teacher is not None:
        teacher = teacher._replace(loss_row=layout.row(spec.teacher.name, "loss"))
    seams = tuple((child, SEAMS[slots[child.name].kind]) for child in spec.per_document)
    return Interface(True, tuple(params), inv_temperature, teacher, layout, tuple(constexprs), fused_rows,
                     weight_rows, seams, x_term)


@lru_cache(maxsize=256)
def launch_constexprs(spec: LossSpec, mode: int, compute_grad: bool) -> dict[str, Any]:
    """TEACHER and SLOT0..SLOT3 of one launch: the slots in FUSED mode only (STATS and GRAD compile the
    same for every label-form child), the teacher's statistics and gradient switches by mode."""
    found = interface(spec)
    fused = mode == MODE_FUSED.value
    teacher = found.teacher
    if teacher.present:
        weight = found.params[teacher.weight]
        teacher = teacher._replace(stats=mode != MODE_GRAD.value,
                                   grad=mode != MODE_STATS.value and compute_grad and weight != 0,
                                   loss_row=teacher.loss_row if fused else -1)
    slots = found.slots if fused else (NO_SLOT,) * MAX_SLOTS
    return {"TEACHER": teacher, **dict(zip(SLOT_ARGUMENTS, slots, strict=True))}


def fused_result(
    totals: torch.Tensor, layout: FusedLayout
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """(losses, metrics, weighted total of the kernel-finished children, value-check counts) from the
    token sums of the kernel's first `layout.summed` term rows."""
    values = totals.unbind()
    losses = {key: value for (is_loss, key), value in zip(layout.keys, values) if is_loss}
    metrics = {key: value for (is_loss, key), value in zip(layout.keys, values) if not is_loss}
    return losses, metrics, values[layout.total], totals[layout.flags :]


@lru_cache(maxsize=64)
def params_on(spec: LossSpec, device: torch.device) -> torch.Tensor:
    """The spec's parameter buffer on `device`, copied once (pinned, so the copy never makes the host wait);
    one unused element when no child has a number."""
    values = torch.tensor(interface(spec).params or [0.0], dtype=torch.float32)
    if device.type == "cuda":
        values = values.pin_memory()
    return values.to(device, non_blocking=True)
