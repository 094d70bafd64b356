"""Gemma 2 family config: sliding-window and global layers alternating (one RoPE for both), (1 + w)
RMSNorms before and after attention and MLP, GeGLU (tanh), the token embedding scaled by sqrt(hidden),
attention scaled by query_pre_attn_scalar^-0.5 with its logits softcapped, and the final logits softcapped
(through the head's softcap: `head_transform`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from fastlm.models.llama.config import LlamaConfig

if TYPE_CHECKING:
    from torch import nn

SLIDING_EVERY = 2  # without layer_types, layers 0, 2, 4, ... slide (transformers' Gemma 2 default)


class Gemma2Config(LlamaConfig):
    type: Literal["gemma2"] = "gemma2"  # type: ignore[assignment]
    query_pre_attn_scalar: int | None = Field(None, gt=0, description="Attention scale^-2; default head_dim.")
    attn_logit_softcap: float | None = Field(50.0, gt=0.0, description="Attention scores -> c * tanh(scores / c).")
    final_logit_softcap: float | None = Field(30.0, gt=0.0, description="The head's softcap (HF final_logit_softcapping).")
    norm_eps: float = Field(1e-6, gt=0.0)
    tie_embeddings: bool = True

    global_every: ClassVar[int | None] = SLIDING_EVERY

    @property
    def embedding_scale(self) -> float:
        return math.sqrt(self.hidden_size)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim or 1) ** -0.5

    def head_transform(self) -> tuple[float, float | None]:
        return 1.0, self.final_logit_softcap

    def build_block(self, layer: int) -> nn.Module:
        from fastlm.models.gemma2.blocks import gemma2_block

        return gemma2_block(self, layer)

    def build_final_norm(self) -> nn.Module:
        from fastlm.layers.norm import build_norm

        return build_norm("rmsnorm_offset", self.hidden_size, self.norm_eps)

    def block_parameters(self, layer: int) -> int:
        return 4 * self.hidden_size + self.attention_parameters() + 3 * self.hidden_size * self.ffn_size

    def architecture(self) -> dict:
        values = super().architecture()
        values["layer_types"] = ["sliding_attention" if self.is_sliding(layer) else "full_attention"
                                 for layer in range(self.num_layers)]
        values["sliding_window"] = self.sliding_window if any(self.is_sliding(i) for i in range(self.num_layers)) else None
        values["query_pre_attn_scalar"] = self.query_pre_attn_scalar or self.head_dim
        return values
