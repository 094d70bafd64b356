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
    (Gemma 2); `sinks` adds a learned per-head sink logit to the softmax (GPT-OSS)."""

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
        self.split_sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(hidden_size, q_size + 2 * kv_size, bias=qkv_bias)
        self.qk_norm_per_head = qk_norm_per_head  # False: one norm over all q (k) heads together (OLMoE)
        q_width, k_width = (self.head_dim, self.head_dim) if qk_norm_per_head else (q_size, kv_size)
        self.q_norm = None if qk_norm is None else build_norm(qk_norm, q_width, norm_eps)
        self.k_norm = None if qk_norm is None else build_norm(qk_norm, k_width, norm_eps)
        self.out_proj = nn.Linear(q_size, hidden_size, bias=out_bias)
        self.softcap = softcap
        self.sinks = nn.Parameter(torch.empty(num_heads)) if sinks else None

    def forward(
        self, x: torch.Tensor, rotary: Rotary | None, layout: AttentionLayout | None, cache: LayerCache | None = None
    ) -> torch.Tensor:
        """x (B, S, H) -> (B, S, H); rotary = (cos, sin) from `rotary_angles` [+ the queries' scale per
        position], or None (GPT-2); `layout`
        from `attention_layout`, built once per forward for this layer's window. Generation passes a `cache`
        instead of a layout: keys/values go into it and attention reads it (fastlm/layers/kv_cache.py)."""
        batch, seq_len, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        if not self.qk_norm_per_head and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(batch, seq_len, self.num_heads, self.head_dim)
        k = k.view(batch, seq_len, self.num_kv_heads, self.head_dim)
        if self.qk_norm_per_head and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary[:2]), apply_rotary(k, *rotary[:2])
            if len(rotary) > 2:  # a per-position query scale (Rope.query_scale)
                q = q * rotary[2][:, None, :, None].to(q.dtype)
        if cache is not None:
            out = cache.attend(q, k, v, self.scale, self.softcap, self.sinks)
        else:
            assert layout is not None
            out = layout.attend(q, k, v, self.dropout if self.training else 0.0, self.scale, self.softcap, self.sinks)
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))

    def reset_parameters(self, std: float, residual_std: float) -> None:
        init_linear(self.qkv_proj, std)
        init_linear(self.out_proj, residual_std)
        if self.sinks is not None:
            nn.init.normal_(self.sinks, mean=0.0, std=std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()
