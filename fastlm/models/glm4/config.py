"""GLM-4 family config: RMSNorm before and after attention and MLP (sandwich), q/k/v biases, grouped kv
heads, SwiGLU, and partial rotary: RoPE on the first `partial_rotary_factor` of each head's dims (GLM
rotates interleaved pairs; the HF adapter reorders the q/k rows so the half-split rotation here equals it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from fastlm.models.base import LayerAttention, Rope, rotary_width
from fastlm.models.llama.config import LlamaConfig

if TYPE_CHECKING:
    from torch import nn


class Glm4Config(LlamaConfig):
    type: Literal["glm4"] = "glm4"  # type: ignore[assignment]
    qkv_bias: bool = True
    partial_rotary_factor: float = Field(0.5, gt=0.0, le=1.0, description="Share of each head's dims RoPE turns.")

    @model_validator(mode="after")
    def _check_rotary_dims(self) -> Glm4Config:
        rotary_width(self.head_dim, self.partial_rotary_factor)  # an odd or empty width raises
        return self

    @property
    def rotary_dims(self) -> int:
        return rotary_width(self.head_dim, self.partial_rotary_factor)

    def layer_attention(self, layer: int) -> LayerAttention:
        attention = super().layer_attention(layer)
        return LayerAttention(attention.window, Rope(self.rope_theta, self.rope_scaling, self.rotary_dims))

    def build_block(self, layer: int) -> nn.Module:
        from fastlm.layers.block import DecoderBlock
        from fastlm.layers.norm import build_norm
        from fastlm.models.llama.blocks import llama_attention, swiglu

        def norm() -> nn.Module:
            return build_norm("rmsnorm", self.hidden_size, self.norm_eps)

        return DecoderBlock(norm(), llama_attention(self), norm(), swiglu(self), self.dropout,
                            post_attn_norm=norm(), post_mlp_norm=norm())

    def block_parameters(self, layer: int) -> int:
        return super().block_parameters(layer) + 2 * self.hidden_size  # the two post norms

    def architecture(self) -> dict[str, Any]:
        return {**super().architecture(), "partial_rotary_factor": self.rotary_dims / (self.head_dim or 1)}
