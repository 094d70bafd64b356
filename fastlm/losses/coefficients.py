"""Per-token statistics -> every child's loss, metrics and gradient coefficients; the fused kernel's row table.

`tail` is the torch tail after the vocab pass (compiled path, tensor-parallel Triton path): it hands
the statistics to each child in turn (`children.base.LossChild.tail`), with no per-kind code here. It is written for few
device ops and no device->host sync: inputs are masked once on first use, and the token sums of all losses and
metrics are reduced together (`metrics.Sums`).

The fused Triton path skips it: the kernel writes the same per-token terms into one (K, T) buffer
laid out by `fused_layout` (each child's `fused_keys`, in child order; a per-document child's
document rows come from its `kernel_seam` launch), and `fused_result` turns its token sums (one
reduction launch) into losses and metrics.
`spec.assemble` (spec.assemble_result) then builds the result of every path the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from fastlm.losses.children.base import Tail, TailInputs
from fastlm.losses.spec import LossNormalizers, LossSpec, LossTargets
from fastlm.losses.validation import value_flag_count


def tail(
    stats: dict[str, torch.Tensor],
    mask: torch.Tensor,
    targets: LossTargets,
    normalizers: LossNormalizers,
    spec: LossSpec,
    grad_scale: float = 1.0,
) -> Tail:
    """Each child's loss and metric sums and its share of the coefficients (times `grad_scale`).
    `stats`: (T,) lse, new_logp, entropy[, teacher_kl, teacher_gap]; any value on masked tokens."""
    dtype = torch.promote_types(stats["lse"].dtype, torch.float32)
    inputs = TailInputs(mask, stats, targets, normalizers, dtype)
    zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    out = Tail(zeros, zeros.clone())
    for child in spec.children:
        child.tail(inputs, out)
    out.sums.resolve()
    if grad_scale != 1.0:
        for name in ("prob", "label", "teacher", "x"):
            if getattr(out, name) is not None:
                setattr(out, name, getattr(out, name) * grad_scale)
    return out


# The per-token state the fused launch writes when a per-document child follows (unscaled, 0 on
# masked tokens): what its `kernel_seam` and the grad launch read (the seam adds its coefficients to
# the last three in place), then each child's `grad_stats`.
STATE_ROWS = ("lse", "new_logp", "entropy", "prob_coeff", "label_coeff", "x_coeff")


@dataclass(frozen=True)
class FusedLayout:
    """Rows of the fused kernel's (K, T) per-token buffer: each child's rows from `starts[name]` (its
    `fused_keys`; a per-document child's loss and document rows come from its `kernel_seam`), then
    the weighted total of the kernel-finished children (not the per-document ones:
    `spec.assemble_result` adds them), all already divided by the step's token count (document
    metrics by the step's documents); rows `flags` to `summed` are the unscaled value-check counts
    (validation.value_flags order); with a per-document child, rows from `state` on are `state_names`
    (STATE_ROWS, then the children's `grad_stats`)."""

    starts: dict[str, int]
    total: int
    flags: int
    summed: int
    state: int
    rows: int
    keys: tuple[tuple[bool, str], ...]  # (is a loss, result key) of each row before `total`
    state_names: tuple[str, ...] = ()

    def state_row(self, terms: torch.Tensor, name: str) -> torch.Tensor:
        """One per-token state vector (a contiguous view of `terms`)."""
        return terms[self.state + self.state_names.index(name)]


@lru_cache(maxsize=256)
def fused_layout(spec: LossSpec) -> FusedLayout:
    """The row table shared by the launcher (each child's `ROW_<KIND>` constexpr) and `fused_result`."""
    keys: list[tuple[bool, str]] = []
    starts: dict[str, int] = {}
    for child in spec.children:
        starts[child.name] = len(keys)
        keys.extend(child.fused_keys())
    total = len(keys)
    summed = total + 1 + value_flag_count(spec)
    state_names = STATE_ROWS + sum((child.grad_stats() for child in spec.children), ()) if spec.per_document else ()
    state = summed if state_names else -1
    return FusedLayout(starts, total, total + 1, summed, state, summed + len(state_names), tuple(keys), state_names)


def fused_result(
    totals: torch.Tensor, layout: FusedLayout
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """(losses, metrics, weighted total of the kernel-finished children, value-check counts) from the
    token sums of the kernel's first `layout.summed` term rows."""
    values = totals.unbind()
    losses = {key: value for (is_loss, key), value in zip(layout.keys, values) if is_loss}
    metrics = {key: value for (is_loss, key), value in zip(layout.keys, values) if not is_loss}
    return losses, metrics, values[layout.total], totals[layout.flags :]
