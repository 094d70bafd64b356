"""Mixtral: Llama/Mistral attention (RoPE, grouped kv heads, optional sliding window) and in every layer
a softmax top-k router over SwiGLU experts (`moe:`), its top-k renormalised."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from fastlm.models.llama.config import LlamaConfig
from fastlm.models.moe_family import MoESettings

if TYPE_CHECKING:
    from torch import nn


class MixtralConfig(LlamaConfig):
    """Llama attention + a sparse MLP per layer; the experts' width is `moe.ffn_size`."""

    type: Literal["mixtral"] = "mixtral"
    moe: MoESettings = Field(default_factory=MoESettings)

    @model_validator(mode="after")
    def _check_moe(self) -> MixtralConfig:
        if self.intermediate_size is not None:
            raise ValueError("a mixtral model has no dense MLP: set the experts' width in moe.ffn_size, "
                             "not intermediate_size")
        return self

    @property
    def ffn_size(self) -> int:
        return self.moe.ffn_size

    def build_block(self, layer: int) -> nn.Module:
        from fastlm.models.llama.blocks import llama_attention
        from fastlm.models.moe_blocks import moe_mlp, pre_norm_block

        return pre_norm_block(self.hidden_size, self.norm_eps, llama_attention(self),
                              moe_mlp(self.hidden_size, self.moe), self.dropout)

    def block_parameters(self, layer: int) -> int:
        return 2 * self.hidden_size + self.attention_parameters() + self.moe.layer_parameters(self.hidden_size)

    def active_blocks_parameters(self) -> int:
        per_layer = 2 * self.hidden_size + self.attention_parameters() + self.moe.active_layer_parameters(self.hidden_size)
        return self.num_layers * per_layer

    def architecture(self) -> dict[str, Any]:
        values = super().architecture()
        values["moe"] = self.moe.model_dump(include={"num_experts", "top_k", "ffn_size", "normalize_top_k"})
        return values
