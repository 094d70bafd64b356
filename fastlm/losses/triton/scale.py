"""Scale a tensor in place by a device scalar, skipping the pass where the scalar is 1, without a host read.

The chunked head (losses/chunked_head.py) computes dH and dW in its forward, before autograd's
grad_output exists, so its backward must multiply them by it. Reading grad_output on the host would stall
the queue once per micro-batch; an unconditional `mul_` reads and writes all of dW (V=131072 x H=2048:
1 GiB in bf16, 2 GiB in fp32, 0.25-0.5 ms on an H200) even for the 1 that `loss.backward()` passes.
Here every program reads the scalar and only touches its blocks when it is not 1: the same result
as `tensor.mul_(scale)` (math in the promoted dtype, rounded back), a launch's cost when it is 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK, NUM_WARPS = 4096, 8
MAX_PROGRAMS = 2048  # a grid-stride loop beyond this many blocks: few programs read the scalar for nothing
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def scale_unless_one_kernel(values_ptr, scale_ptr, n_values, BLOCK: tl.constexpr):
    scale = tl.load(scale_ptr)
    if scale != 1.0:
        offsets = tl.arange(0, BLOCK)
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n_values, step):
            mask = start + offsets < n_values
            values = tl.load(values_ptr + start + offsets, mask=mask)
            tl.store(values_ptr + start + offsets, (values * scale).to(values_ptr.dtype.element_ty), mask=mask)


def scale_unless_one(tensor: torch.Tensor, scale: torch.Tensor) -> None:
    """tensor *= scale (a one-element tensor on tensor's device), in place; nothing moves where scale is 1."""
    if scale.numel() != 1 or tensor.dtype not in DTYPES or scale.dtype not in DTYPES or not tensor.is_contiguous():
        tensor.mul_(scale)
        return
    scale = scale.to(torch.float32).reshape(1)  # the math in fp32 for every 16-bit tensor, as mul_ does
    programs = min(triton.cdiv(tensor.numel(), BLOCK), MAX_PROGRAMS)
    if programs:
        scale_unless_one_kernel[(programs,)](tensor, scale, tensor.numel(), BLOCK=BLOCK, num_warps=NUM_WARPS)
