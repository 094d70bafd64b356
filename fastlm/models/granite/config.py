"""Granite family config: the Llama block with four multipliers: on the token embedding, on each
residual branch, the attention scale (in place of 1/sqrt(head_dim)), and 1 / logits_scaling on the
logits (the head's logit_scale: `head_transform`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from fastlm.models.llama.config import LlamaConfig

if TYPE_CHECKING:
    from torch import nn


class GraniteConfig(LlamaConfig):
    type: Literal["granite"] = "granite"  # type: ignore[assignment]
    embedding_multiplier: float = Field(1.0, gt=0.0, description="Factor on the token embedding.")
    residual_multiplier: float = Field(1.0, gt=0.0, description="Factor on each attention / MLP branch.")
    attention_multiplier: float = Field(1.0, gt=0.0, description="The attention scale (replaces 1/sqrt(head_dim)).")
    logits_scaling: float = Field(1.0, gt=0.0, description="The logits are divided by it (the head's logit_scale).")
    norm_eps: float = Field(1e-6, gt=0.0)

    @property
    def embedding_scale(self) -> float:
        return self.embedding_multiplier

    def head_transform(self) -> tuple[float, float | None]:
        return 1.0 / self.logits_scaling, None

    def build_block(self, layer: int) -> nn.Module:
        from fastlm.layers.block import DecoderBlock
        from fastlm.layers.norm import build_norm
        from fastlm.models.llama.blocks import llama_attention, swiglu

        return DecoderBlock(build_norm("rmsnorm", self.hidden_size, self.norm_eps),
                            llama_attention(self, scale=self.attention_multiplier),
                            build_norm("rmsnorm", self.hidden_size, self.norm_eps), swiglu(self), self.dropout,
                            residual_scale=self.residual_multiplier)
