"""Per-token statistics -> every child's loss, metrics and gradient coefficients.

`tail` is the torch tail after the vocab pass (compiled path, the Triton path under tensor parallelism
or with a child that has no fused slot): it hands the statistics to each child in turn
(`children.base.LossChild.tail`), with no per-kind code here. It is written for few device ops and no
device->host sync: inputs are masked once on first use, and the token sums of all losses and metrics
are reduced together (`metrics.Sums`).

The fused Triton path skips it: the kernel writes the same per-token terms into one (K, T) buffer
laid out by `triton.interface.FusedLayout` (generated from the children's slots), and
`interface.fused_result` turns its token sums (one reduction launch) into losses and metrics.
`spec.assemble_result` then builds the result of every path the same way.
"""

from __future__ import annotations

import torch

from fastlm.losses.children.base import Tail, TailInputs
from fastlm.losses.spec import LossSpec
from fastlm.losses.tensors import LossNormalizers, LossTargets


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
