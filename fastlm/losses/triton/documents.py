"""loss_type grpo's per-token weight in one launch: w_t = scale / |i| for token t of document i.

`|i|` counts the unmasked tokens of document i, a run of equal ids in the flattened batch
(`children.policy.document_slots` is the torch form of the same numbering, and gives the same values
bit for bit: the division is correctly rounded like torch's). The torch form is about twelve small
launches per call; this is one program that walks the tokens twice in blocks: the first pass numbers
the runs (a cumulative sum carried across blocks) and records, at each run's first and last token,
the unmasked count before it and up to it; after a barrier the second pass divides. No sort, no
device->host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastlm.losses.spec import IGNORE_INDEX

MAX_BLOCK = 4096  # tokens per step with 16 warps: 83 registers, no spill on sm_90 (8192 spills)


@triton.jit
def _run_weights_kernel(ids_ptr, labels_ptr, weights_ptr, runs_ptr, bounds_ptr, n, scale, BLOCK: tl.constexpr,
                        IGNORE: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    runs_before = 0  # runs started before this block
    count_before = 0  # unmasked tokens before this block
    for start in range(0, n, BLOCK):
        t = start + offsets
        inside = t < n
        ids = tl.load(ids_ptr + t, mask=inside)
        previous = tl.load(ids_ptr + t - 1, mask=inside & (t > 0))
        following = tl.load(ids_ptr + t + 1, mask=t + 1 < n)
        unmasked = (tl.load(labels_ptr + t, mask=inside, other=IGNORE) != IGNORE).to(tl.int32)
        first = inside & ((t == 0) | (ids != previous))
        last = inside & ((t == n - 1) | (ids != following))
        run = runs_before + tl.cumsum(first.to(tl.int32), 0)  # 1, 2, ... in token order
        count = count_before + tl.cumsum(unmasked, 0)  # unmasked tokens up to t, inclusive
        tl.store(runs_ptr + t, run, mask=inside)
        tl.store(bounds_ptr + 2 * run, count - unmasked, mask=first)
        tl.store(bounds_ptr + 2 * run + 1, count, mask=last)
        runs_before += tl.sum(first.to(tl.int32), 0)
        count_before += tl.sum(unmasked, 0)
    tl.debug_barrier()  # one program: its stores above are visible to all its threads below
    for start in range(0, n, BLOCK):
        t = start + offsets
        inside = t < n
        run = tl.load(runs_ptr + t, mask=inside, other=0)
        length = tl.load(bounds_ptr + 2 * run + 1, mask=inside, other=1) - tl.load(bounds_ptr + 2 * run, mask=inside,
                                                                                  other=0)
        unmasked = tl.load(labels_ptr + t, mask=inside, other=IGNORE) != IGNORE
        # length >= 1 on an unmasked token (0 only in a run without one); div_rn rounds like torch's division
        length = tl.maximum(length, 1).to(tl.float32)
        weight = tl.where(unmasked, tl.math.div_rn(tl.full([BLOCK], scale, tl.float32), length), 0.0)
        tl.store(weights_ptr + t, weight, mask=inside)


def document_mean_weights(
    document_ids: torch.Tensor, labels: torch.Tensor, scale: float, max_block: int = MAX_BLOCK
) -> torch.Tensor:
    """(T,) float32: `scale` / (unmasked tokens of the token's document) on unmasked tokens, 0 on
    masked ones; documents are runs of equal `document_ids`, masked tokens are labels -100.
    `max_block` (a power of two) caps the tokens per step (tests use small ones)."""
    tokens = labels.numel()
    weights = torch.empty(tokens, dtype=torch.float32, device=labels.device)
    if tokens == 0:
        return weights
    runs = torch.empty(tokens, dtype=torch.int32, device=labels.device)
    bounds = torch.empty(2 * (tokens + 1), dtype=torch.int32, device=labels.device)
    block = min(max_block, triton.next_power_of_2(tokens))
    _run_weights_kernel[(1,)](document_ids.contiguous(), labels.contiguous(), weights, runs, bounds, tokens,
                              float(scale), BLOCK=block, IGNORE=IGNORE_INDEX, num_warps=max(4, block // 256))
    return weights
