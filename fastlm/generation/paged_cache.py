"""A paged key/value cache: fixed-size blocks in one pool per layer, a block table per sequence.

Memory follows the tokens held, not rows x longest: a sequence owns ceil(tokens / block_size) blocks, and
the G samples of a prompt share the prompt's blocks (reference counts, `BlockAllocator`). Layers are
grouped by attention window (the decoder's `windows`: global layers in one group, each sliding window in
another); each group has its own allocator and its own block table per sequence, so a sliding-window
group releases a sequence's blocks once they fall out of the window while the global group keeps them.

Layout: per layer a keys and a values pool of shape (1, kv_heads, num_blocks * block_size, head_dim),
block b holding pool columns [b * block_size, (b + 1) * block_size). Block 0 is the scratch block: never
allocated, it takes the writes of padding tokens (column -1) and dead decode slots (table rows of zeros).
A token at logical column c of its sequence (its position: columns start at 0, nothing is left-padded)
lives at pool column table[c // block_size] * block_size + c % block_size.

The decoder's cache hooks are those of `KVCache` (fastlm/layers/kv_cache.py): `positions`,
`attention_mask` per window, `layer(...).attend(q, k, v, scale)`; the engine binds the forward's block
tables first (`bind`). Attention reads the sequence's blocks in one of two ways:
- gather (prefill, CPU): the table's blocks are gathered into (B, kv_heads, W * block_size, head_dim) and
  SDPA runs with the additive mask "key column <= own column, within the window" (the static cache's rule);
- flex (one-token decode on CUDA): FlexAttention over the whole pool with a block mask whose kv indices are
  the table's physical blocks from the first visible one to the row's own, so only those are read
  (FlexAttention's paged decode; keys and values have batch 1 and every query row indexes into them). The
  mask_mod maps a pool column back to its logical column through a (B, num_blocks) physical-to-logical
  table built from the block table, and applies the gather path's rule (the fused kernel evaluates it only
  in the listed blocks; the unfused CPU kernel everywhere).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fastlm.layers.attention_kernels import flex_attend
from fastlm.layers.kv_cache import DECODE_QUERY_BLOCK, DecodeAttention

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

SCRATCH = 0  # the block that padding writes go to; never allocated


class BlockAllocator:
    """Blocks 1 .. count - 1 of one window group, with reference counts (block 0 is the scratch block)."""

    def __init__(self, count: int) -> None:
        if count < 2:
            raise ValueError(f"a paged cache needs at least 2 blocks (one is scratch), got {count}")
        self.count = count
        self.free: list[int] = list(range(count - 1, 0, -1))
        self.references = [0] * count

    @property
    def available(self) -> int:
        return len(self.free)

    @property
    def used(self) -> int:
        return self.count - 1 - len(self.free)

    def allocate(self) -> int:
        block = self.free.pop()
        self.references[block] = 1
        return block

    def share(self, block: int) -> int:
        self.references[block] += 1
        return block

    def release(self, block: int) -> None:
        if block == SCRATCH:
            return
        self.references[block] -= 1
        if self.references[block] == 0:
            self.free.append(block)


@dataclass(frozen=True)
class PagedMask:
    """One forward's attention mask for one window group: additive (gather + SDPA) or a flex block mask."""

    group: int
    slots: torch.Tensor  # (B * S,) pool columns the forward's tokens are written at
    additive: torch.Tensor | None = None  # (B, 1, groups * S, W * block_size)
    blocks: BlockMask | None = None


class PagedLayer:
    """One layer's view of the paged cache during one forward (what `Attention` calls `attend` on)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, table: torch.Tensor,
                 block_size: int, mask: PagedMask) -> None:
        self.keys, self.values, self.slots, self.table, self.block_size, self.mask = (
            keys, values, slots, table, block_size, mask)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
               softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Write k, v (B, Hkv, S, D) at the tokens' pool columns, then attend q (B, Hq, S, D) over the
        sequence's blocks under the mask -> (B, Hq, S, D). A score softcap or sinks are not served here
        (`engine_supports` sends those models to the static generator)."""
        if softcap is not None or sinks is not None:
            raise ValueError("the paged cache attends without a score softcap or sinks; use the static generator")
        batch, q_heads, seq_len, head_dim = q.shape
        kv_heads = k.shape[1]
        flat = (kv_heads, batch * seq_len, head_dim)
        self.keys[0].index_copy_(1, self.slots, k.to(self.keys.dtype).transpose(0, 1).reshape(flat))
        self.values[0].index_copy_(1, self.slots, v.to(self.values.dtype).transpose(0, 1).reshape(flat))
        if self.mask.blocks is not None:
            return flex_attend(q.to(self.keys.dtype), self.keys, self.values, self.mask.blocks, scale).to(q.dtype)
        columns = (self.table[:, :, None] * self.block_size + torch.arange(self.block_size, device=q.device)).flatten(1)
        keys = self.keys[0][:, columns].transpose(0, 1)  # (B, Hkv, W * block_size, D)
        values = self.values[0][:, columns].transpose(0, 1)
        grouped_q = q.reshape(batch, kv_heads, q_heads // kv_heads * seq_len, head_dim).to(keys.dtype)
        out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=self.mask.additive, scale=scale)
        return out.reshape(batch, q_heads, seq_len, head_dim).to(q.dtype)


class PagedKVCache:
    """Block pools of every layer, one allocator per window group (see the module docstring)."""

    def __init__(self, layer_groups: list[int], windows: list[int | None], q_heads: int, kv_heads: int,
                 head_dim: int, block_size: int, num_blocks: int, dtype: torch.dtype, device: torch.device | str,
                 decode_attention: DecodeAttention = "sdpa") -> None:
        shape = (1, kv_heads, num_blocks * block_size, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in layer_groups]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in layer_groups]
        self.layer_groups, self.windows = layer_groups, windows
        self.allocators = [BlockAllocator(num_blocks) for _ in windows]
        self.block_size, self.num_blocks, self.groups = block_size, num_blocks, q_heads // kv_heads
        self.decode_attention = decode_attention
        self.tables: list[torch.Tensor] = []  # per window group (B, W): bound for the next forward

    @staticmethod
    def block_bytes(num_layers: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block index takes across every layer's key and value pools."""
        return 2 * num_layers * kv_heads * block_size * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def buffers(self) -> list[torch.Tensor]:
        return self.keys + self.values

    def layers_in(self, group: int) -> list[int]:
        return [layer for layer, g in enumerate(self.layer_groups) if g == group]

    def copy_blocks(self, group: int, sources: list[int], targets: list[int]) -> None:
        """Copy blocks' keys and values in every layer of a window group (shared partial blocks made private)."""
        device, size = self.keys[0].device, self.block_size
        offsets = torch.arange(size, device=device)
        source = (torch.tensor(sources, device=device)[:, None] * size + offsets).flatten()
        target = (torch.tensor(targets, device=device)[:, None] * size + offsets).flatten()
        for layer in self.layers_in(group):
            for pool in (self.keys[layer], self.values[layer]):
                pool.index_copy_(2, target, pool.index_select(2, source))

    def bind(self, tables: list[torch.Tensor]) -> None:
        """The block tables (B, W) of the next forward's rows, one per window group (zeros: scratch)."""
        self.tables = tables

    def positions(self, columns: torch.Tensor) -> torch.Tensor:
        """(B, S) position ids: the columns (padding, at -1, gets 0)."""
        return columns.clamp_min(0)

    def slots(self, group: int, columns: torch.Tensor) -> torch.Tensor:
        """(B * S,) pool columns of tokens at logical `columns` (B, S); padding (-1) goes to the scratch block."""
        table = self.tables[group]
        safe = columns.clamp(0, table.shape[1] * self.block_size - 1)
        blocks = table.gather(1, safe // self.block_size)
        return torch.where(columns >= 0, blocks * self.block_size + safe % self.block_size, SCRATCH).flatten()

    def attention_mask(self, columns: torch.Tensor, span: int, sliding_window: int | None) -> PagedMask:
        """The mask of a forward of tokens at `columns` (B, S) for the layers of window `sliding_window`
        (`span` is the static cache's; the bound table sets what is read here)."""
        group = self.windows.index(sliding_window)
        slots = self.slots(group, columns)
        if self.decode_attention == "flex" and columns.shape[1] == 1:
            return PagedMask(group, slots, blocks=self.decode_block_mask(group, columns, sliding_window))
        return PagedMask(group, slots, additive=self.mask(group, columns, sliding_window))

    def mask(self, group: int, columns: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
        """(B, 1, groups * S, W * block_size) additive mask over the gathered blocks: key column j is visible
        to the token at column c iff j <= c and (window) c - j < window; a token always sees itself (padding
        sees column 0), so no row is all -inf."""
        span = self.tables[group].shape[1] * self.block_size
        keys = torch.arange(span, device=columns.device)[None, None]
        query = columns[:, :, None]
        visible = keys <= query
        if sliding_window is not None:
            visible &= query - keys < sliding_window
        visible = (visible | (keys == query.clamp_min(0))).repeat(1, self.groups, 1)
        blocked = torch.full(visible.shape, float("-inf"), dtype=self.keys[0].dtype, device=columns.device)
        return blocked.masked_fill(visible, 0.0)[:, None]

    def decode_block_mask(self, group: int, columns: torch.Tensor, sliding_window: int | None) -> BlockMask:
        """FlexAttention block mask of one decode step (`columns` (B, 1)) over the whole pool: row b lists the
        physical blocks of its logical blocks low // size .. c // size (c its column, low the first visible)."""
        from torch.nn.attention.flex_attention import BlockMask

        table, size = self.tables[group], self.block_size
        width = table.shape[1]
        own = columns[:, 0].clamp_min(0)
        low = torch.zeros_like(own) if sliding_window is None else (own - sliding_window + 1).clamp_min(0)
        first = low // size
        count = own // size - first + 1
        logical = (first[:, None] + torch.arange(width, device=own.device)).clamp(max=width - 1)
        indices = table.gather(1, logical)
        logical_of = torch.full((table.shape[0], self.num_blocks), -1, dtype=torch.int32, device=table.device)
        logical_of.scatter_(1, table, torch.arange(width, dtype=torch.int32, device=table.device).expand_as(table))
        logical_of[:, SCRATCH] = -1  # padding entries of the table all point at the scratch block
        return BlockMask.from_kv_blocks(
            count.to(torch.int32)[:, None, None], indices.to(torch.int32)[:, None, None],
            BLOCK_SIZE=(DECODE_QUERY_BLOCK, size), mask_mod=self.decode_mask_mod(logical_of, low, own),
            seq_lengths=(1, self.num_blocks * size), compute_q_blocks=False,
        )

    def decode_mask_mod(self, logical_of: torch.Tensor, low: torch.Tensor, own: torch.Tensor) -> Callable:
        """Pool column k of row b is visible iff its block is one of the row's and its logical column lies in
        [low[b], own[b]] (`mask`'s rule); the row's own column always is."""
        size = self.block_size

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            block = logical_of[b, k // size]
            column = block * size + k % size
            return (block >= 0) & (column >= low[b]) & (column <= own[b])

        return mask_mod

    def layer(self, index: int, columns: torch.Tensor, span: int, mask: PagedMask) -> PagedLayer:
        return PagedLayer(self.keys[index], self.values[index], mask.slots, self.tables[mask.group], self.block_size,
                          mask)
