"""Ministral 3 family config: the Mistral block (grouped-query attention, SwiGLU, an optional sliding window
on every layer), yarn RoPE, and the rotated queries scaled by 1 + beta * log(1 + floor(position / period))
(transformers' llama_4_scaling_beta, period the yarn's original context)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from fastlm.models.base import LayerAttention, Rope
from fastlm.models.ministral.config import MinistralConfig


class Ministral3Config(MinistralConfig):
    type: Literal["ministral3"] = "ministral3"  # type: ignore[assignment]
    rope_theta: float = Field(1_000_000.0, gt=0.0)
    query_scale_beta: float = Field(0.1, ge=0.0, description="Queries x 1 + beta * log(1 + floor(pos / period)).")
    query_scale_period: int = Field(16384, ge=1, description="The period (HF original_max_position_embeddings).")

    @model_validator(mode="after")
    def _one_window(self) -> Ministral3Config:
        if self.layer_types is not None:
            raise ValueError("ministral3 applies its sliding_window to every layer; leave layer_types unset")
        return self

    def layer_attention(self, layer: int) -> LayerAttention:
        attention = super().layer_attention(layer)
        assert attention.rope is not None
        scale = (self.query_scale_beta, self.query_scale_period) if self.query_scale_beta else None
        return LayerAttention(attention.window, Rope(attention.rope.theta, attention.rope.scaling, query_scale=scale))

    def architecture(self) -> dict[str, Any]:
        values = super().architecture()
        if not self.query_scale_beta:
            values["query_scale_period"] = None  # no scale: the period does nothing
        return values
