"""OLMoE: Llama attention whose q and k projections are RMS-normalised over their full width (all heads
together, before RoPE), and in every layer a softmax top-k router over SwiGLU experts (`moe:`; OLMoE-1B-7B
does not renormalise the top-k)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from fastlm.models.llama.config import LlamaConfig
from fastlm.models.moe_family import MoESettings

if TYPE_CHECKING:
    from torch import nn


class OlmoeConfig(LlamaConfig):
    """Llama attention + full-width QK-norm + a sparse MLP per layer; the experts' width is `moe.ffn_size`."""

    type: Literal["olmoe"] = "olmoe"
    moe: MoESettings = Field(default_factory=lambda: MoESettings(normalize_top_k=False))

    @model_validator(mode="after")
    def _check_moe(self) -> OlmoeConfig:
        if self.intermediate_size is not None:
            raise ValueError("an olmoe model has no dense MLP: set the experts' width in moe.ffn_size, "
                             "not intermediate_size")
        return self

    @property
    def ffn_size(self) -> int:
        return self.moe.ffn_size

    def build_block(self, layer: int) -> nn.Module:
        from fastlm.models.llama.blocks import llama_attention
        from fastlm.models.moe_blocks import moe_mlp, pre_norm_block

        attention = llama_attention(self, qk_norm="rmsnorm", qk_norm_per_head=False)
        return pre_norm_block(self.hidden_size, self.norm_eps, attention, moe_mlp(self.hidden_size, self.moe),
                              self.dropout)

    def attention_parameters(self) -> int:
        """Llama's, plus the q and k norms' weights (full width)."""
        head_dim = self.head_dim or 0
        return super().attention_parameters() + (self.num_heads + self.kv_heads) * head_dim

    def block_parameters(self, layer: int) -> int:
        return 2 * self.hidden_size + self.attention_parameters() + self.moe.layer_parameters(self.hidden_size)

    def active_blocks_parameters(self) -> int:
        per_layer = 2 * self.hidden_size + self.attention_parameters() + self.moe.active_layer_parameters(self.hidden_size)
        return self.num_layers * per_layer

    def architecture(self) -> dict[str, Any]:
        values = super().architecture()
        values["moe"] = self.moe.model_dump(include={"num_experts", "top_k", "ffn_size", "normalize_top_k"})
        return values
