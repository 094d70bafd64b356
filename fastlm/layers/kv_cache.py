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
additive (0 / -inf in the cache dtype), built once per forward for each distinct sliding window (global
layers share one, windowed layers another).
Left-padded rows write the same columns (`uniform_columns`: one `index_copy_`); otherwise each row
scatters into its own.

A latent cache (multi-head latent attention, `value_dim` set): one kv head whose values are the first
`value_dim` columns of its keys, so each layer holds one buffer and `values` are views of it.

Grouped-query attention reads the cache without repeating it: the g query heads that share a kv head
become g query rows of that head, (B, Hkv, g * S, D) against (B, Hkv, span, D).

Linear-attention layers (Gated DeltaNet, fastlm/layers/gated_deltanet.py) keep no keys and values: the
cache holds their `RecurrentState` instead (the last conv_kernel - 1 convolution inputs and the (heads,
key_dim, value_dim) state per row, a fixed size), and `KVCache.layer` hands them a `RecurrentLayerCache`.
A recurrence cannot skip a token the way a mask does, so the cache says which tokens of a forward are
real (`real_tokens`): columns at or after the row's `start` and before its `ends` (the generator sets
`ends` around a ragged prefill), of rows not `frozen` (the generator points it at its rows' done flags:
a finished row's decode steps, and a stop token fed back, change nothing). A forward whose first column
is 0 starts its rows afresh (a new generation on a reused cache).

Decode attention (`decode_attention="flex"`, the CUDA-graph default): a one-token step over the whole
cache runs FlexAttention with a block mask instead of SDPA with the additive mask. A static graph must
attend over every column of the preallocated cache, but the block mask lists, per row, only the key
blocks from its first visible column to its own, so the blocks not yet written are never read; torch.compile
lowers it to the flash-decoding kernel (grouped query heads packed into one block per kv head). The
mask_mod repeats the additive mask's rule inside the listed blocks. Prefill and CPU use SDPA.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from fastlm.layers.attention_kernels import explicit_attention, flex_attend, flex_supported

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

DecodeAttention = Literal["sdpa", "flex"]
def decode_attention_for(wanted: DecodeAttention, device: torch.device | str, head_dim: int) -> DecodeAttention:
    """`wanted`, except on CUDA with heads too small for FlexAttention: SDPA over the whole cache (the
    additive mask; graph-safe too)."""
    return "sdpa" if torch.device(device).type == "cuda" and not flex_supported(device, head_dim) else wanted
DECODE_KEY_BLOCK = 64  # FlexAttention key block of the decode block mask (the flash-decoding kernel's BLOCK_N on H100)
DECODE_QUERY_BLOCK = 128


@dataclass
class LayerCache:
    """One layer's view of the cache during one forward: where to write and what to attend over."""

    keys: torch.Tensor  # (B, Hkv, length, D)
    values: torch.Tensor
    columns: torch.Tensor  # (B, S) cache column of each token of this forward
    span: int  # attend over columns [0, span)
    uniform_columns: bool  # every row writes the same columns (left padding)
    mask: CacheMask  # from `KVCache.attention_mask`, shared by the layers with this layer's window
    values_in_keys: bool = False  # a latent cache: `values` is a view of `keys`, written with them

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
               softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Write k, v (B, Hkv, S, D) at `columns` (a latent cache: k alone, v being its first columns), then
        softmax(q K^T * scale + mask) V over the cache (scale None: 1/sqrt(d)); a score `softcap` and per-head
        `sinks` as in training (`explicit_attention`).

        q (B, Hq, S, D) -> (B, Hq, S, Dv).
        """
        batch, q_heads, seq_len, head_dim = q.shape
        kv_heads = k.shape[1]
        k, v = k.to(self.keys.dtype), v.to(self.values.dtype)
        written = ((self.keys, k),) if self.values_in_keys else ((self.keys, k), (self.values, v))
        for buffer, new in written:
            if self.uniform_columns:
                buffer.index_copy_(2, self.columns[0], new)
            else:
                buffer.scatter_(2, self.columns[:, None, :, None].expand(batch, kv_heads, seq_len, new.shape[-1]), new)
        if self.mask.blocks is not None:
            return flex_attend(q.to(self.keys.dtype), self.keys, self.values, self.mask.blocks, scale,
                               softcap, sinks).to(q.dtype)
        keys, values = self.keys[:, :, : self.span], self.values[:, :, : self.span]
        if softcap is not None or sinks is not None:  # the mask's first S rows: it repeats them per group
            mask = self.mask.additive[:, :, :seq_len] if self.mask.additive is not None else None
            return explicit_attention(q.to(keys.dtype), keys, values, mask, scale, softcap, sinks).to(q.dtype)
        groups, mask = q_heads // kv_heads, self.mask.additive
        if mask is not None and mask.shape[2] != groups * seq_len:  # a layer grouped unlike the cache's default
            mask = mask[:, :, :seq_len].repeat(1, 1, groups, 1)
        grouped_q = q.reshape(batch, kv_heads, groups * seq_len, head_dim).to(keys.dtype)
        out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=mask, scale=scale)
        return out.reshape(batch, q_heads, seq_len, -1).to(q.dtype)


@dataclass(frozen=True)
class RecurrentShape:
    """What a linear-attention layer keeps per row: `conv_width` - 1 inputs of `conv_channels`, and a state
    of `heads` x `key_dim` x `value_dim`."""

    conv_channels: int
    conv_width: int
    heads: int
    key_dim: int
    value_dim: int


@dataclass
class RecurrentState:
    """One linear-attention layer's cache: conv (B, conv_width - 1, C) in the cache dtype, state (B, H, K, V) fp32."""

    conv: torch.Tensor
    state: torch.Tensor

    @classmethod
    def empty(cls, shape: RecurrentShape, batch: int, dtype: torch.dtype, device: torch.device | str) -> RecurrentState:
        return cls(torch.zeros(batch, shape.conv_width - 1, shape.conv_channels, dtype=dtype, device=device),
                   torch.zeros(batch, shape.heads, shape.key_dim, shape.value_dim,
                               dtype=torch.promote_types(dtype, torch.float32), device=device))


@dataclass
class RecurrentLayerCache:
    """A linear-attention layer's view of the cache during one forward: its state, which tokens are real
    (B, S), and which rows carry their state on (`keep` (B,): False starts the row afresh)."""

    conv: torch.Tensor
    state: torch.Tensor
    real: torch.Tensor
    keep: torch.Tensor

    def next_window(self, window: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """The conv window after this forward: the last conv_width - 1 inputs up to each row's last real
        token (`inputs` (B, S, C), not-real ones zeroed), the old `window` (B, K-1, C) where too few."""
        taps, steps = window.shape[1], inputs.shape[1]
        extended = torch.cat([window.to(inputs.dtype), inputs], dim=1)
        counted = torch.arange(1, steps + 1, device=inputs.device)
        ends = (self.real.to(torch.int64) * counted).amax(dim=1)  # tokens up to the last real one (0: none)
        index = ends[:, None] + torch.arange(taps, device=inputs.device)
        return extended.gather(1, index[..., None].expand(-1, -1, extended.shape[2])).to(window.dtype)


@dataclass(frozen=True)
class CacheMask:
    """What one forward's layers attend under: an additive mask for SDPA or a FlexAttention block mask."""

    additive: torch.Tensor | None = None  # (B, 1, groups * S, span)
    blocks: BlockMask | None = None


class KVCache:
    """Keys and values of every layer for `batch` rows of up to `length` tokens (see the module docstring)."""

    def __init__(
        self, num_layers: int, batch: int, q_heads: int, kv_heads: int, length: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | str, uniform_columns: bool = False,
        decode_attention: DecodeAttention = "sdpa", recurrent: list[RecurrentShape | None] | None = None,
        value_dim: int | None = None, layer_shapes: list[tuple[int, int]] | None = None,
        kv_sources: list[int] | None = None,
    ) -> None:
        """`recurrent`: per layer, the state of a linear-attention layer (no keys and values) or None.
        `layer_shapes`: per layer (kv heads, head_dim) where the layers differ (Gemma 4's global layers);
        the masks are built for `kv_heads` and re-cut per layer for the others (`LayerCache.attend`).
        `kv_sources`: per layer, the layer whose cache it reads (Gemma 4's shared KV: `DecoderConfig.kv_source`);
        a layer that reads another's holds no columns of its own."""
        recurrent = recurrent or [None] * num_layers
        shapes = layer_shapes or [(kv_heads, head_dim)] * num_layers
        owns = [source == index for index, source in enumerate(kv_sources or range(num_layers))]
        self.keys = [torch.zeros((batch, heads, length if own and not r else 0, width), dtype=dtype, device=device)
                     for r, own, (heads, width) in zip(recurrent, owns, shapes)]
        self.values_in_keys = value_dim is not None  # a latent cache (module docstring)
        self.values = ([keys[..., :value_dim] for keys in self.keys] if value_dim is not None else
                       [torch.zeros_like(keys) for keys in self.keys])
        self.states = {index: RecurrentState.empty(r, batch, dtype, device) for index, r in enumerate(recurrent) if r}
        self.start = torch.zeros(batch, dtype=torch.int64, device=device)
        self.ends = torch.full((batch,), length, dtype=torch.int64, device=device)
        self.frozen = torch.zeros(batch, dtype=torch.bool, device=device)
        self.length = length
        self.groups = q_heads // kv_heads
        self.uniform_columns = uniform_columns
        self.decode_attention = decode_attention_for(decode_attention, device, min(width for _, width in shapes))

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every tensor a decode step updates in place (a latent cache's values are views of its keys)."""
        states = [t for state in self.states.values() for t in (state.conv, state.state)]
        return self.keys + self.values + states + [self.ends]

    def real_tokens(self, columns: torch.Tensor) -> torch.Tensor:
        """(B, S) bool: the tokens at `columns` a recurrence takes in (see the module docstring)."""
        return (columns >= self.start[:, None]) & (columns < self.ends[:, None]) & ~self.frozen[:, None]

    def positions(self, columns: torch.Tensor) -> torch.Tensor:
        """(B, S) position ids of tokens at cache `columns` (0 on left padding)."""
        return (columns - self.start[:, None]).clamp_min(0)

    def attention_mask(self, columns: torch.Tensor, span: int, sliding_window: int | None) -> CacheMask:
        """The mask of a forward of tokens at `columns` (B, S) over the first `span` columns: a block mask
        for one-token decode steps over the whole cache under `decode_attention="flex"`, else additive."""
        if self.decode_attention == "flex" and columns.shape[1] == 1 and span == self.length:
            return CacheMask(blocks=self.decode_block_mask(columns, sliding_window))
        return CacheMask(additive=self.mask(columns, span, sliding_window))

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

    def decode_block_mask(self, columns: torch.Tensor, sliding_window: int | None) -> BlockMask:
        """FlexAttention block mask of one decode step (`columns` (B, 1)) over the whole cache.

        Row b sees the columns [low, c] with c its own column and low = max(start[b], c - window + 1), so it
        needs the key blocks low // block .. c // block (contiguous): those are listed, every other block
        (later ones not written yet, earlier ones padding or out of the window) is skipped. All listed
        blocks go through `mask_mod` (no second list of fully visible blocks: evaluating the mask is cheap next
        to reading a block)."""
        from torch.nn.attention.flex_attention import BlockMask

        blocks = -(-self.length // DECODE_KEY_BLOCK)
        own = columns[:, 0]
        low = self.start if sliding_window is None else torch.maximum(self.start, own - sliding_window + 1)
        first = torch.minimum(low, own) // DECODE_KEY_BLOCK  # a row always sees its own column
        count = own // DECODE_KEY_BLOCK - first + 1
        indices = (first[:, None] + torch.arange(blocks, device=own.device)).clamp(max=blocks - 1)
        return BlockMask.from_kv_blocks(
            count.to(torch.int32)[:, None, None], indices.to(torch.int32)[:, None, None],
            BLOCK_SIZE=(DECODE_QUERY_BLOCK, DECODE_KEY_BLOCK), mask_mod=self.decode_mask_mod(columns, sliding_window),
            seq_lengths=(1, self.length), compute_q_blocks=False,
        )

    def decode_mask_mod(self, columns: torch.Tensor, sliding_window: int | None) -> Callable:
        """FlexAttention mask_mod of `mask` for one token per row at `columns` (B, 1)."""
        start = self.start

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            own = columns[b, q]
            visible = (k >= start[b]) & (k <= own)
            if sliding_window is not None:
                visible = visible & (own - k < sliding_window)
            return visible | (k == own)

        return mask_mod

    def layer(self, index: int, columns: torch.Tensor, span: int,
              mask: CacheMask) -> LayerCache | RecurrentLayerCache:
        state = self.states.get(index)
        if state is not None:
            return RecurrentLayerCache(state.conv, state.state, self.real_tokens(columns), columns[:, 0] != 0)
        return LayerCache(self.keys[index], self.values[index], columns, span, self.uniform_columns, mask,
                          self.values_in_keys)
