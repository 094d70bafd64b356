"""SmolLM3 family config: the Llama block (grouped-query attention, SwiGLU, tied embeddings) where some
layers attend without positions (NoPE: no rotary embedding): by default every 4th layer."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from fastlm.models.base import LayerAttention
from fastlm.models.llama.config import LlamaConfig

NOPE_EVERY = 4  # without nope_layers, every 4th layer has no RoPE (SmolLM3's no_rope_layer_interval)


class SmolLM3Config(LlamaConfig):
    type: Literal["smollm3"] = "smollm3"  # type: ignore[assignment]
    rope_theta: float = Field(2_000_000.0, gt=0.0)
    norm_eps: float = Field(1e-6, gt=0.0)
    tie_embeddings: bool = True
    nope_layers: list[int] | None = Field(None, description="Layers without RoPE; None: every 4th (3, 7, 11, ...).")

    @model_validator(mode="after")
    def _check_nope_layers(self) -> SmolLM3Config:
        bad = [layer for layer in self.nope_layers or () if not 0 <= layer < self.num_layers]
        if bad or len(set(self.nope_layers or ())) != len(self.nope_layers or ()):
            raise ValueError(f"nope_layers {self.nope_layers} must list distinct layers in [0, {self.num_layers})")
        return self

    def has_rope(self, layer: int) -> bool:
        if self.nope_layers is None:
            return (layer + 1) % NOPE_EVERY != 0
        return layer not in self.nope_layers

    def layer_attention(self, layer: int) -> LayerAttention:
        attention = super().layer_attention(layer)
        return attention if self.has_rope(layer) else LayerAttention(attention.window, None)

    def architecture(self) -> dict[str, Any]:
        return {**super().architecture(),
                "nope_layers": [layer for layer in range(self.num_layers) if not self.has_rope(layer)]}
