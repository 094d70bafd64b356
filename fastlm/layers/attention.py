"""Multi-head / grouped-query self-attention: projections here, the kernel chosen per forward.

The decoder builds one `AttentionLayout` per forward (fastlm/layers/packed_attention.py) and every
layer attends through it: SDPA `is_causal` when nothing else is masked (flash attention on GPU),
FlexAttention with a document / sliding-window block mask for packed rows on GPU, or SDPA with the
boolean (B, 1, S, S) mask "causal AND same document AND within the window" (the kernels and the mask are
fastlm/layers/attention_kernels.py's). Layers with different windows (sliding vs global) get different
layouts; the decoder builds one per distinct window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from fastlm.layers.init import init_linear
from fastlm.layers.kv_cache import LayerCache
from fastlm.layers.norm import NormKind, build_norm
from fastlm.layers.rotary import apply_rotary

if TYPE_CHECKING:
    from fastlm.layers.packed_attention import AttentionLayout

Rotary = tuple[torch.Tensor, ...]  # cos, sin [, the queries' (B or 1, S) scale after RoPE]


class Attention(nn.Module):
    """Fused qkv projection (q heads, then k heads, then v heads), optional per-head q/k norm (QK-norm:
    Qwen3, Gemma 3), optional RoPE, output projection. `head_dim` may differ from hidden / heads;
    `scale` replaces 1/sqrt(head_dim) (Gemma's query_pre_attn_scalar^-0.5); `softcap` softcaps the scores
    (Gemma 2); `sinks` adds a learned per-head sink logit to the softmax (GPT-OSS). `values_from_keys`: no
    value projection, the values are the keys' projection before the key norm and RoPE (Gemma 4's
    attention_k_eq_v: qkv_proj holds q and k rows only); `value_norm`: the values RMS-normalised per head
    without a weight (Gemma 4's v_norm); `shared_kv`: no key/value projections, the layer attends over the keys
    and values of an earlier layer (Gemma 4's num_kv_shared_layers), which the decoder passes to `forward` (that
    layer's `keeps_kv`: its forward leaves them in `kept_kv` for the decoder to take)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        qkv_bias: bool,
        out_bias: bool,
        dropout: float,
        head_dim: int | None = None,
        qk_norm: NormKind | None = None,
        norm_eps: float = 1e-6,
        scale: float | None = None,
        qk_norm_per_head: bool = True,
        softcap: float | None = None,
        sinks: bool = False,
        values_from_keys: bool = False,
        value_norm: bool = False,
        shared_kv: bool = False,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim or hidden_size // num_heads
        self.dropout = dropout
        self.scale = scale
        q_size, kv_size = num_heads * self.head_dim, num_kv_heads * self.head_dim
        self.values_from_keys = values_from_keys
        kv_rows = () if shared_kv else (kv_size,) if values_from_keys else (kv_size, kv_size)
        self.split_sizes = (q_size, *kv_rows)
        self.qkv_proj = nn.Linear(hidden_size, sum(self.split_sizes), bias=qkv_bias)
        self.qk_norm_per_head = qk_norm_per_head  # False: one norm over all q (k) heads together (OLMoE)
        q_width, k_width = (self.head_dim, self.head_dim) if qk_norm_per_head else (q_size, kv_size)
        self.q_norm = None if qk_norm is None else build_norm(qk_norm, q_width, norm_eps)
        self.k_norm = None if qk_norm is None or shared_kv else build_norm(qk_norm, k_width, norm_eps)
        self.out_proj = nn.Linear(q_size, hidden_size, bias=out_bias)
        self.softcap = softcap
        self.sinks = nn.Parameter(torch.empty(num_heads)) if sinks else None
        self.v_norm = nn.RMSNorm(self.head_dim, eps=norm_eps, elementwise_affine=False) \
            if value_norm and not shared_kv else None
        # a layer whose keys and values later layers share: its forward leaves them here, the decoder takes them
        self.keeps_kv = False
        self.kept_kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(
        self, x: torch.Tensor, rotary: Rotary | None, layout: AttentionLayout | None, cache: LayerCache | None = None,
        shared_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x (B, S, H) -> (B, S, H); rotary = (cos, sin) from `rotary_angles` [+ the queries' scale per
        position], or None (GPT-2); `layout`
        from `attention_layout`, built once per forward for this layer's window. Generation passes a `cache`
        instead of a layout: keys/values go into it and attention reads it (fastlm/layers/kv_cache.py)."""
        batch, seq_len, _ = x.shape
        q, *kv_rows = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        if not self.qk_norm_per_head and self.q_norm is not None:
            q = self.q_norm(q)
        q = q.view(batch, seq_len, self.num_heads, self.head_dim)
        if self.qk_norm_per_head and self.q_norm is not None:
            q = self.q_norm(q)
        q = q.transpose(1, 2)
        if rotary is not None:
            q = apply_rotary(q, *rotary[:2])
            if len(rotary) > 2:  # a per-position query scale (Rope.query_scale)
                q = q * rotary[2][:, None, :, None].to(q.dtype)
        if len(self.split_sizes) == 1:  # an earlier layer's keys and values (in generation: its cache too)
            assert shared_kv is not None, "a layer without key/value projections needs the shared_kv of its source"
            k, v = shared_kv
        else:
            k, v = self._keys_values(kv_rows, batch, seq_len, rotary)
            if self.keeps_kv:
                self.kept_kv = (k, v)
        if cache is not None:
            out = cache.attend(q, k, v, self.scale, self.softcap, self.sinks)
        else:
            assert layout is not None
            out = layout.attend(q, k, v, self.dropout if self.training else 0.0, self.scale, self.softcap, self.sinks)
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))

    def _keys_values(self, rows: list[torch.Tensor], batch: int, seq_len: int,
                     rotary: Rotary | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, Hkv, S, D) keys (normed, rotated) and values (optionally normed) from the k (and v) projection rows."""
        k = rows[0]
        v = k if self.values_from_keys else rows[1]
        if not self.qk_norm_per_head and self.k_norm is not None:
            k = self.k_norm(k)
        k = k.view(batch, seq_len, self.num_kv_heads, self.head_dim)
        if self.qk_norm_per_head and self.k_norm is not None:
            k = self.k_norm(k)
        k = k.transpose(1, 2)
        if rotary is not None:
            k = apply_rotary(k, *rotary[:2])
        v = v.view(batch, seq_len, self.num_kv_heads, self.head_dim)
        return k, (v if self.v_norm is None else self.v_norm(v)).transpose(1, 2)

    def __getstate__(self) -> dict[str, object]:
        """Copies and pickles leave the last forward's kept keys and values behind (they hold autograd graph tensors)."""
        return {**self.__dict__, "kept_kv": None}

    def reset_parameters(self, std: float, residual_std: float) -> None:
        init_linear(self.qkv_proj, std)
        init_linear(self.out_proj, residual_std)
        if self.sinks is not None:
            nn.init.normal_(self.sinks, mean=0.0, std=std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()
