"""Gemma 3 family config (text): local (sliding-window) and global layers with their own RoPE bases,
(1 + w) RMSNorms before and after attention and MLP, QK-norm, GeGLU (tanh), the token embedding scaled
by sqrt(hidden), attention scaled by query_pre_attn_scalar^-0.5."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from fastlm.models.base import LayerAttention, Rope
from fastlm.models.llama.config import LlamaConfig

if TYPE_CHECKING:
    from torch import nn

GLOBAL_EVERY = 6  # without layer_types, every 6th layer is global (Gemma 3's 5 local : 1 global)


class Gemma3Config(LlamaConfig):
    type: Literal["gemma3"] = "gemma3"  # type: ignore[assignment]
    rope_theta: float = Field(1_000_000.0, gt=0.0, description="RoPE base of the global layers.")
    rope_local_theta: float = Field(10_000.0, gt=0.0, description="RoPE base of the sliding-window layers (unscaled).")
    query_pre_attn_scalar: int | None = Field(None, gt=0, description="Attention scale^-2; default head_dim.")
    norm_eps: float = Field(1e-6, gt=0.0)
    tie_embeddings: bool = True

    global_every: ClassVar[int | None] = GLOBAL_EVERY

    def layer_attention(self, layer: int) -> LayerAttention:
        if self.is_sliding(layer):
            return LayerAttention(self.sliding_window, Rope(self.rope_local_theta))
        return LayerAttention(None, Rope(self.rope_theta, self.rope_scaling))

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size or 4 * self.hidden_size

    @property
    def embedding_scale(self) -> float:
        return math.sqrt(self.hidden_size)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim or 1) ** -0.5

    def build_block(self, layer: int) -> nn.Module:
        from fastlm.models.gemma3.blocks import gemma3_block

        return gemma3_block(self, layer)

    def build_final_norm(self) -> nn.Module:
        from fastlm.layers.norm import build_norm

        return build_norm("rmsnorm_offset", self.hidden_size, self.norm_eps)

    def block_parameters(self, layer: int) -> int:
        # four sandwich norms, q_norm and k_norm
        return 4 * self.hidden_size + 2 * (self.head_dim or 0) + self.attention_parameters() + \
            3 * self.hidden_size * self.ffn_size

    def architecture(self) -> dict:
        values = super().architecture()
        values["layer_types"] = ["sliding_attention" if self.is_sliding(layer) else "full_attention"
                                 for layer in range(self.num_layers)]
        values["query_pre_attn_scalar"] = self.query_pre_attn_scalar or self.head_dim
        return values
