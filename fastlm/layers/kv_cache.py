"""A static (preallocated) key/value cache for generation with the training decoder.

Layout: per layer one (B, kv_heads, length, head_dim) buffer each for keys and values, allocated once for a
batch and a maximum length, so a decode step has fixed shapes (what a CUDA graph needs). Separate
per-layer buffers, written with `index_copy_`/`scatter_`, let torch.compile update them in place (a
write into a view of one stacked buffer is functionalised into a copy of the whole buffer per layer). Rows may be
left-padded: `start[b]` is row b's first real column, and a token at cache column c has position
c - start[b] (RoPE angle or GPT-2 position id). A forward writes its tokens' keys and values at
`columns` (B, S) and attends over the first `span` columns with the mask "key column in [start, own
column], within the sliding window"; a token may always see itself, so a padding query never has an
empty row (an all-masked row would give NaN, and 0 * NaN poisons the real rows' sums). The mask is
additive (0 / -inf in the cache dtype), built once per forward for all layers.
Left-padded rows write the same columns (`uniform_columns`: one `index_copy_`); otherwise each row
scatters into its own.

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
    uniform_columns: bool  # every row writes the same columns (left padding)
    mask: torch.Tensor  # (B, 1, groups * S, span) additive, from `KVCache.mask`, shared by all layers

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write k, v (B, Hkv, S, D) at `columns`, then softmax(q K^T / sqrt(d) + mask) V over the cache.

        q (B, Hq, S, D) -> (B, Hq, S, D).
        """
        batch, q_heads, seq_len, head_dim = q.shape
        kv_heads = k.shape[1]
        k, v = k.to(self.keys.dtype), v.to(self.values.dtype)
        if self.uniform_columns:
            self.keys.index_copy_(2, self.columns[0], k)
            self.values.index_copy_(2, self.columns[0], v)
        else:
            index = self.columns[:, None, :, None].expand(batch, kv_heads, seq_len, head_dim)
            self.keys.scatter_(2, index, k)
            self.values.scatter_(2, index, v)
        keys, values = self.keys[:, :, : self.span], self.values[:, :, : self.span]
        grouped_q = q.reshape(batch, kv_heads, q_heads // kv_heads * seq_len, head_dim).to(keys.dtype)
        out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=self.mask)
        return out.reshape(batch, q_heads, seq_len, head_dim).to(q.dtype)


class KVCache:
    """Keys and values of every layer for `batch` rows of up to `length` tokens (see the module docstring)."""

    def __init__(
        self, num_layers: int, batch: int, q_heads: int, kv_heads: int, length: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | str, uniform_columns: bool = False,
    ) -> None:
        shape = (batch, kv_heads, length, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.start = torch.zeros(batch, dtype=torch.int64, device=device)
        self.length = length
        self.groups = q_heads // kv_heads
        self.uniform_columns = uniform_columns

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]

    @property
    def buffers(self) -> list[torch.Tensor]:
        return self.keys + self.values

    def positions(self, columns: torch.Tensor) -> torch.Tensor:
        """(B, S) position ids of tokens at cache `columns` (0 on left padding)."""
        return (columns - self.start[:, None]).clamp_min(0)

    def mask(self, columns: torch.Tensor, span: int, sliding_window: int | None) -> torch.Tensor:
        """(B, 1, groups * S, span) additive mask: 0 where key column j is visible to the token at column c
        of row b, -inf elsewhere; the S query rows repeat for each of the `groups` query heads of a kv head."""
        keys = torch.arange(span, device=columns.device)[None, None]
        query = columns[:, :, None]
        visible = (keys >= self.start[:, None, None]) & (keys <= query)
        if sliding_window is not None:
            visible &= query - keys < sliding_window
        visible = (visible | (keys == query)).repeat(1, self.groups, 1)
        blocked = torch.full(visible.shape, float("-inf"), dtype=self.keys[0].dtype, device=columns.device)
        return blocked.masked_fill(visible, 0.0)[:, None]

    def layer(self, index: int, columns: torch.Tensor, span: int, mask: torch.Tensor) -> LayerCache:
        return LayerCache(self.keys[index], self.values[index], columns, span, self.uniform_columns, mask)
