"""OLMo 3 family config: OLMo 2's blocks (norms after attention and MLP, full-width QK-norm), three
sliding-window layers to one global layer, each kind with its own RoPE (the global layers' may be scaled,
e.g. yarn; the sliding layers' is plain)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from fastlm.models.base import LayerAttention, Rope
from fastlm.models.olmo2.config import Olmo2Config

GLOBAL_EVERY = 4  # without layer_types, every 4th layer is global (transformers' OLMo 3 default)


class Olmo3Config(Olmo2Config):
    type: Literal["olmo3"] = "olmo3"  # type: ignore[assignment]
    sliding_window: int | None = Field(4096, ge=1)
    rope_local_theta: float = Field(500_000.0, gt=0.0, description="RoPE base of the sliding-window layers (unscaled).")

    global_every: ClassVar[int | None] = GLOBAL_EVERY

    def layer_attention(self, layer: int) -> LayerAttention:
        if self.is_sliding(layer):
            return LayerAttention(self.sliding_window, Rope(self.rope_local_theta))
        return LayerAttention(None, Rope(self.rope_theta, self.rope_scaling))

    def architecture(self) -> dict[str, Any]:
        values = super().architecture()
        values["layer_types"] = ["sliding_attention" if self.is_sliding(layer) else "full_attention"
                                 for layer in range(self.num_layers)]
        values["sliding_window"] = self.sliding_window if "sliding_attention" in values["layer_types"] else None
        return values
