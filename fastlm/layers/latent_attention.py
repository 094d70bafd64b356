"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Moonlight): keys and values come from one compressed
latent per token, c = norm(W_DKV x) (kv_lora_rank wide), expanded per head by `kv_b_proj` into a no-RoPE key
part and the value; the RoPE part of every head's key is one decoupled `qk_rope_head_dim`-wide key shared by
all heads. Queries come from x directly (`q_proj`) or through their own low-rank latent (`q_a_proj`, norm,
`q_b_proj`) when `q_lora_rank` is set.

Training and evaluation expand the latent to full per-head keys and values and attend through the
forward's layout (SDPA causal, dense mask or FlexAttention block mask), as transformers does. Generation
caches only the latent and the rotated shared key, (kv_lora_rank + qk_rope_head_dim) numbers per token
and layer instead of heads * (qk_head_dim + v_head_dim): the key expansion is absorbed into the query
(q_nope W_UK_h per head) and the value expansion applied after attention (o W_UV_h^T), so the cached
attention is multi-query attention with one kv head whose key is [c, k_rope] and whose value is c, the
first kv_lora_rank columns of the same cache row (`KVCache(value_dim=...)`: no second buffer).

`rope_interleave` (DeepSeek's checkpoints): the rotary dimensions are laid out in pairs (x0, x1), (x2, x3), ...;
they are gathered evens-then-odds before the half-split rotation, which gives transformers'
`apply_rotary_pos_emb_interleave` exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from fastlm.layers.init import init_linear
from fastlm.layers.kv_cache import LayerCache
from fastlm.layers.norm import build_norm
from fastlm.layers.rotary import apply_rotary

if TYPE_CHECKING:
    from fastlm.layers.packed_attention import AttentionLayout

Rotary = tuple[torch.Tensor, torch.Tensor]


class LatentAttention(nn.Module):
    """MLA (see the module docstring); `scale` is the softmax scale (qk_head_dim^-0.5, times yarn's mscale^2);
    the latents' norms use `latent_norm_eps` (transformers: 1e-6, not the config's rms_norm_eps)."""

    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, scale: float,
                 rope_interleave: bool, dropout: float = 0.0, latent_norm_eps: float = 1e-6) -> None:
        super().__init__()
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.scale, self.rope_interleave, self.dropout = scale, rope_interleave, dropout
        q_width = num_heads * (qk_nope_head_dim + qk_rope_head_dim)
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, q_width, bias=False)
            self.q_a_proj = self.q_a_norm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
            self.q_a_norm = build_norm("rmsnorm", q_lora_rank, latent_norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, q_width, bias=False)
        self.kv_a_proj = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_norm = build_norm("rmsnorm", kv_lora_rank, latent_norm_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.out_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=False)

    def _rotate(self, x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        if self.rope_interleave:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rotary(x, *rotary)

    def forward(self, x: torch.Tensor, rotary: Rotary | None, layout: AttentionLayout | None,
                cache: LayerCache | None = None) -> torch.Tensor:
        """x (B, S, H) -> (B, S, H), as `Attention.forward` (a layout in training, a cache in generation)."""
        assert rotary is not None, "latent attention always has a rotary key part"
        batch, seq_len, _ = x.shape
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q = q.view(batch, seq_len, self.num_heads, self.nope_dim + self.rope_dim).transpose(1, 2)
        q_nope, q_rope = q.split((self.nope_dim, self.rope_dim), dim=-1)
        latent, k_rope = self.kv_a_proj(x).split((self.kv_lora_rank, self.rope_dim), dim=-1)
        latent = self.kv_a_norm(latent)
        q_rope = self._rotate(q_rope, rotary)
        k_rope = self._rotate(k_rope[:, None], rotary)  # (B, 1, S, rope): one key shared by the heads
        if cache is None:
            assert layout is not None
            kv = self.kv_b_proj(latent).view(batch, seq_len, self.num_heads, self.nope_dim + self.v_head_dim)
            k_nope, v = kv.transpose(1, 2).split((self.nope_dim, self.v_head_dim), dim=-1)
            k = torch.cat((k_nope, k_rope.expand(-1, self.num_heads, -1, -1)), dim=-1)
            out = layout.attend(torch.cat((q_nope, q_rope), dim=-1), k, v, self.dropout if self.training else 0.0,
                                self.scale)
        else:
            w_uk, w_uv = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_head_dim,
                                                    self.kv_lora_rank).split((self.nope_dim, self.v_head_dim), dim=1)
            q_latent = torch.einsum("bhsn,hnr->bhsr", q_nope, w_uk)
            key = torch.cat((latent[:, None], k_rope), dim=-1)  # (B, 1, S, rank + rope): the cached row
            attended = cache.attend(torch.cat((q_latent, q_rope), dim=-1), key, latent[:, None], self.scale)
            out = torch.einsum("bhsr,hvr->bhsv", attended, w_uv)
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))

    def reset_parameters(self, std: float, residual_std: float) -> None:
        for linear in (self.q_proj, self.q_a_proj, self.q_b_proj, self.kv_a_proj, self.kv_b_proj):
            if linear is not None:
                init_linear(linear, std)
        init_linear(self.out_proj, residual_std)
        for norm in (self.q_a_norm, self.kv_a_norm):
            if norm is not None:
                norm.reset_parameters()
