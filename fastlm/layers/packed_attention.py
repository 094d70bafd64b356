"""How the rows of a training batch attend to each other: one layout per forward, shared by every layer.

`attention_layout` looks at the batch once (packed documents? sliding window? device? dropout?) and
picks the kernel; `AttentionLayout.attend` runs it in every layer:

- causal: no documents and no window -> SDPA `is_causal` (flash attention on GPU; grouped heads native).
- flex (CUDA): packed documents and/or a sliding window -> FlexAttention with a block mask built once
  per batch. Key blocks outside a query block's document are skipped and fully visible blocks skip the
  mask; grouped kv heads are read in place (`enable_gqa`).
- dense (CPU, attention dropout on GPU, which FlexAttention lacks, or heads under `FLEX_MIN_HEAD_DIM`,
  which its CUDA kernels refuse): SDPA with a boolean (B, 1, S, S) mask. On CPU it is the fast choice:
  FlexAttention there is either an unfused fallback that materialises the scores anyway or a C++ compile
  per shape, which would slow the embedded default.

Measured choice (docs/benchmarks.md, "Attention for packed documents"): on the H200, llama-1b shape with
~300-token documents, FlexAttention's forward + backward is 2x faster than the dense mask (1.10 vs
2.18 ms) and close to causal flash attention without documents (0.91 ms); varlen flash attention with
grouped heads is not in torch 2.11.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Literal

import torch

from fastlm.layers.attention_kernels import FLEX_MIN_HEAD_DIM, attend, attention_mask, flex_attend, flex_supported

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

LayoutKind = Literal["causal", "dense", "flex"]
BLOCK_SIZE = 128  # FlexAttention's sparse block (query and key)


def packed_kind(device: torch.device, head_dim: int, dropout_active: bool = False) -> LayoutKind:
    """The layout of rows with packed documents or a sliding window: flex where it runs, else dense."""
    return "flex" if flex_supported(device, head_dim) and not dropout_active else "dense"


@dataclass(frozen=True)
class AttentionLayout:
    """What every layer of one forward needs to attend: the kind, plus its dense or block mask."""

    kind: LayoutKind
    dense_mask: torch.Tensor | None = None
    block_mask: BlockMask | None = None
    positions: torch.Tensor | None = None  # (B, S) in-document positions of packed rows (linear attention restarts)

    @cached_property
    def segments(self) -> tuple[torch.Tensor, list[int]]:
        """The packed documents as one flattened row's offsets (fla's `cu_seqlens`), on the device and on the
        host: the one read of the device a forward of packed rows with linear-attention layers makes (a
        varlen kernel's launch grid needs the count), computed on first use and shared by those layers."""
        assert self.positions is not None
        flat = self.positions.reshape(-1)
        starts = (flat == 0).nonzero().reshape(-1)
        offsets = torch.cat([starts, starts.new_tensor([flat.numel()])])
        return offsets, offsets.tolist()

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
               scale: float | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(q k^T * scale + mask) v for q (B, Hq, S, D), k and v (B, Hkv, S, D), Hq = g * Hkv
        (scale None: 1/sqrt(D)); optional score `softcap` and per-head `sinks` (`explicit_attention`)."""
        if self.kind == "causal" and q.device.type == "cuda" and not dropout_p and (softcap is not None or sinks is not None):
            # SDPA has no softcap or sinks: FlexAttention with a causal block mask, not the explicit O(S^2) scores
            return flex_attend(q, k, v, causal_block_mask(q.shape[2], q.device), scale, softcap, sinks)
        if self.kind != "flex":
            return attend(q, k, v, self.dense_mask, dropout_p, scale, softcap, sinks)
        if dropout_p:
            raise ValueError("FlexAttention has no attention dropout; build the layout with dropout_active=True")
        return flex_attend(q, k, v, self.block_mask, scale, softcap, sinks)


def document_mask_mod(positions: torch.Tensor | None, sliding_window: int | None) -> Callable:
    """FlexAttention mask_mod: query q may see key k iff 0 <= q - k <= positions[b, q] (same document,
    see `attention_mask`) and q - k < sliding_window."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        distance = q - k
        allowed = distance >= 0
        if positions is not None:
            allowed = allowed & (distance <= positions[b, q])
        if sliding_window is not None:
            allowed = allowed & (distance < sliding_window)
        return allowed

    return mask_mod


def flex_block_mask(
    positions: torch.Tensor | None, sliding_window: int | None, batch: int, seq_len: int, device: torch.device,
    block_size: int = BLOCK_SIZE,
) -> BlockMask:
    """The block mask of `document_mask_mod`, computed from the documents directly (a few small kernels,
    no host sync) instead of `create_block_mask`'s pass over every (query, key) pair.

    Query q sees the keys [low(q), q] with low(q) = q - min(positions[q], window - 1). The union of these
    intervals over a query block ends at the block's last query and is contiguous, so the block needs the
    key blocks from min(low) // block_size up to its own; those also at or past ceil(max(low) / block_size)
    and before the diagonal are full (every pair allowed: `mask_mod` is skipped there). Padding past
    `seq_len` is never allowed, as in `create_block_mask` (tests check the two agree block for block).
    """
    from torch.nn.attention.flex_attention import BlockMask

    rows = batch if positions is not None else 1
    blocks = -(-seq_len // block_size)
    index = torch.arange(blocks * block_size, device=device)
    reach = torch.zeros(rows, blocks * block_size, dtype=torch.long, device=device)  # how far back q sees
    reach[:, :seq_len] = index[:seq_len] if positions is None else positions
    if sliding_window is not None:
        reach = reach.clamp(max=sliding_window - 1)
    low = (index - reach).view(rows, blocks, block_size)
    valid = (index < seq_len).view(1, blocks, block_size)
    lowest = low.masked_fill(~valid, seq_len).amin(-1)  # (rows, blocks): per query block
    highest = low.masked_fill(~valid, 0).amax(-1)
    query_block = torch.arange(blocks, device=device)[:, None]  # (blocks, 1) against key blocks (1, blocks)
    key_block = torch.arange(blocks, device=device)[None]
    needed = (key_block >= (lowest // block_size)[..., None]) & (key_block <= query_block)
    whole_queries = ((query_block + 1) * block_size <= seq_len)
    full = (key_block * block_size >= highest[..., None]) & (key_block < query_block) & whole_queries
    partial = needed & ~full

    def ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dense = dense[:, None].to(torch.int32)  # (rows, 1 head, query blocks, key blocks)
        order = torch.argsort(dense, dim=-1, descending=True, stable=True)
        return dense.sum(-1).to(torch.int32), order.to(torch.int32)

    return BlockMask.from_kv_blocks(
        *ordered(partial), *ordered(full), BLOCK_SIZE=block_size,
        mask_mod=document_mask_mod(positions, sliding_window), seq_lengths=(seq_len, seq_len),
    )


@torch._disable_dynamo  # torch.compiler.disable at the first call: built eagerly once per length, also in a compiled block
@lru_cache(maxsize=8)
def causal_block_mask(seq_len: int, device: torch.device) -> BlockMask:
    """The plain causal block mask of one row (the causal layout's, for score options SDPA lacks), kept per length."""
    return flex_block_mask(None, None, 1, seq_len, device)


def attention_layout(
    batch: int,
    seq_len: int,
    positions: torch.Tensor | None,
    sliding_window: int | None,
    device: torch.device,
    dropout_active: bool = False,
    kind: LayoutKind | None = None,
    *,
    head_dim: int = FLEX_MIN_HEAD_DIM,
) -> AttentionLayout:
    """The layout for rows with in-document `positions` (None: one document per row); `kind` forces one
    (tests, benchmarks), else causal when nothing is masked, then `packed_kind` (for heads of `head_dim`)."""
    if kind is None:
        kind = "causal" if positions is None and sliding_window is None else packed_kind(device, head_dim, dropout_active)
    if kind == "causal":
        if positions is not None or sliding_window is not None:
            raise ValueError("the causal layout cannot mask packed documents or a sliding window")
        return AttentionLayout("causal")
    if kind == "flex":
        return AttentionLayout("flex", block_mask=flex_block_mask(positions, sliding_window, batch, seq_len, device),
                               positions=positions)
    return AttentionLayout("dense", dense_mask=attention_mask(seq_len, positions, sliding_window, device),
                           positions=positions)
