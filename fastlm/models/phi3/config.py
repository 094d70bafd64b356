"""Phi-3 family config: the Llama block (SwiGLU, RoPE, grouped kv heads) with HF's fused qkv and gate_up
weights, an optional sliding window on every layer, head_dim = hidden / heads, no biases; RoPE on all of each
head or its first `partial_rotary_factor` (Phi-4-mini: 0.75)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fastlm.models.base import LayerAttention, Rope, rotary_width
from fastlm.models.llama.config import LlamaConfig


class Phi3Config(LlamaConfig):
    type: Literal["phi3"] = "phi3"  # type: ignore[assignment]

    norm_eps: float = Field(1e-5, gt=0.0)
    partial_rotary_factor: float = Field(1.0, gt=0.0, le=1.0, description="Share of each head's dims RoPE turns "
                                         "(the first ones; Phi-4-mini 0.75).")

    @model_validator(mode="after")
    def _phi3_shape(self) -> Phi3Config:
        if self.qkv_bias:
            raise ValueError("phi3 has no q/k/v biases (qkv_bias must be false)")
        if self.layer_types is not None:
            raise ValueError("phi3 applies its sliding_window to every layer; leave layer_types unset")
        if (self.head_dim or 0) * self.num_heads != self.hidden_size:
            raise ValueError(f"phi3 has head_dim = hidden_size / num_heads = {self.hidden_size // self.num_heads}")
        rotary_width(self.head_dim, self.partial_rotary_factor)  # an odd or empty width raises
        return self

    @property
    def rotary_dims(self) -> int:
        return rotary_width(self.head_dim, self.partial_rotary_factor)

    def layer_attention(self, layer: int) -> LayerAttention:
        attention = super().layer_attention(layer)
        dims = None if self.partial_rotary_factor == 1.0 else self.rotary_dims
        return LayerAttention(attention.window, Rope(self.rope_theta, self.rope_scaling, dims))
