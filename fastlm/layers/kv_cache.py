"""A static (preallocated) key/value cache for generation with the training decoder.

Layout: one (layers, B, kv_heads, length, head_dim) buffer each for keys and values, allocated once for a
batch and a maximum length, so a decode step has fixed shapes (what a CUDA graph needs). Rows may be
left-padded: `start[b]` is row b's first real column, and a token at cache column c has position
c - start[b] (RoPE angle or GPT-2 position id). A forward writes its tokens' keys and values at
`columns` (B, S) and attends over the first `span` columns with the mask "key column in [start, own
column], within the sliding window"; a token may always see itself, so a padding query never has an
empty row (an all-masked row would give NaN, and 0 * NaN poisons the real rows' sums).

Grouped-query attention reads the cache without repeating it: the g query heads that share a kv head
become g query rows of that head, (B, Hkv, g * S, D) against (B, Hkv, span, D).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LayerCache:
    """One layer's view of the cache during one forward: where to write and what to attend over."""

    keys: torch.Tensor  # (B, Hkv, length, D)
    values: torch.Tensor
    columns: torch.Tensor  # (B, S) cache column of each token of this forward
    span: int  # attend over columns [0, span)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Write k, v (B, Hkv, S, D) at `columns`, then softmax(q K^T / sqrt(d) + mask) V over the cache.

        q (B, Hq, S, D), mask (B, 1, S, span) boolean (True = may attend) -> (B, Hq, S, D).
        """
        batch, q_heads, seq_len, head_dim = q.shape
        kv_heads = k.shape[1]
        index = self.columns[:, None, :, None].expand(batch, kv_heads, seq_len, head_dim)
        self.keys.scatter_(2, index, k.to(self.keys.dtype))
        self.values.scatter_(2, index, v.to(self.values.dtype))
        keys, values = self.keys[:, :, : self.span], self.values[:, :, : self.span]
        groups = q_heads // kv_heads
        grouped_q = q.reshape(batch, kv_heads, groups * seq_len, head_dim).to(keys.dtype)
        grouped_mask = mask if groups == 1 else mask.repeat(1, 1, groups, 1)
        out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=grouped_mask)
        return out.reshape(batch, q_heads, seq_len, head_dim).to(q.dtype)


class KVCache:
    """Keys and values of every layer for `batch` rows of up to `length` tokens (see the module docstring)."""

    def __init__(
        self, num_layers: int, batch: int, kv_heads: int, length: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | str,
    ) -> None:
        shape = (num_layers, batch, kv_heads, length, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.start = torch.zeros(batch, dtype=torch.int64, device=device)
        self.length = length

    @property
    def batch(self) -> int:
        return self.keys.shape[1]

    def positions(self, columns: torch.Tensor) -> torch.Tensor:
        """(B, S) position ids of tokens at cache `columns` (0 on left padding)."""
        return (columns - self.start[:, None]).clamp_min(0)

    def mask(self, columns: torch.Tensor, span: int, sliding_window: int | None) -> torch.Tensor:
        """(B, 1, S, span) boolean: key column j is visible to the token at column c of row b."""
        keys = torch.arange(span, device=columns.device)[None, None]
        query = columns[:, :, None]
        visible = (keys >= self.start[:, None, None]) & (keys <= query)
        if sliding_window is not None:
            visible &= query - keys < sliding_window
        return (visible | (keys == query))[:, None]

    def layer(self, index: int, columns: torch.Tensor, span: int) -> LayerCache:
        return LayerCache(self.keys[index], self.values[index], columns, span)
