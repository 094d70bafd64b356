"""The full-attention layer of Qwen3-Next / Qwen3.5: grouped-query attention whose query projection also
gives a per-head output gate (out = attention * sigmoid(gate) before the output projection), zero-centred
QK-norm ((1 + w) RMSNorm per head) and partial RoPE (only the first `rotary_dim` of each head rotates)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from fastlm.layers.attention import Attention, Rotary
from fastlm.layers.kv_cache import LayerCache
from fastlm.layers.rotary import apply_rotary

if TYPE_CHECKING:
    from fastlm.layers.packed_attention import AttentionLayout


class GatedAttention(Attention):
    """`Attention` with the gate: `qkv_proj` holds, per query head, its query rows then its gate rows (the
    checkpoint's q_proj as it is), then the k and v heads; `rotary` is (cos, sin) of `rotary_dim` / 2
    frequencies."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int,
                 norm_eps: float, dropout: float = 0.0) -> None:
        super().__init__(hidden_size, num_heads, num_kv_heads, qkv_bias=False, out_bias=False, dropout=dropout,
                         head_dim=head_dim, qk_norm="rmsnorm_offset", norm_eps=norm_eps)
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and in (0, head_dim={head_dim}]")
        self.rotary_dim = rotary_dim
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.split_sizes = (2 * q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(hidden_size, 2 * q_size + 2 * kv_size, bias=False)

    def forward(self, x: torch.Tensor, rotary: Rotary | None, layout: AttentionLayout | None,
                cache: LayerCache | None = None) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        query_gate, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q, gate = query_gate.view(batch, seq_len, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        assert self.q_norm is not None and self.k_norm is not None
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(k.view(batch, seq_len, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if rotary is not None:  # (cos, sin) of rotary_dim / 2 angles: apply_rotary turns the first rotary_dim only
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if cache is not None:
            out = cache.attend(q, k, v, self.scale)
        else:
            assert layout is not None
            out = layout.attend(q, k, v, self.dropout if self.training else 0.0, self.scale)
        out = out.transpose(1, 2).reshape(batch, seq_len, -1) * torch.sigmoid(gate.reshape(batch, seq_len, -1))
        return self.out_proj(out)
