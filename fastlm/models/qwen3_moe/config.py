"""Qwen3-MoE: Qwen3's attention (RMSNorm on each q and k head before RoPE, decoupled head_dim) and a sparse
MLP (`moe:`, softmax top-k, renormalised per `moe.normalize_top_k`) in every layer but `dense_layers`,
which keep Qwen3's SwiGLU MLP of `intermediate_size` (HF mlp_only_layers / decoder_sparse_step)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from fastlm.models.moe_family import MoESettings, check_dense_layers
from fastlm.models.qwen3.config import Qwen3Config

if TYPE_CHECKING:
    from torch import nn


class Qwen3MoeConfig(Qwen3Config):
    type: Literal["qwen3_moe"] = "qwen3_moe"  # type: ignore[assignment]
    moe: MoESettings = Field(default_factory=MoESettings)
    dense_layers: list[int] = Field(default_factory=list, description="Layers with a dense MLP instead of experts.")

    @model_validator(mode="after")
    def _check_dense_layers(self) -> Qwen3MoeConfig:
        check_dense_layers(self.dense_layers, self.num_layers)
        return self

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers

    def build_block(self, layer: int) -> nn.Module:
        if not self.is_sparse(layer):
            return super().build_block(layer)
        from fastlm.models.llama.blocks import pre_norm_block
        from fastlm.models.qwen3.blocks import qwen3_attention

        return pre_norm_block(self, qwen3_attention(self), self.moe.build(self.hidden_size))

    def _sparse_instead_of_dense(self, moe_parameters: int) -> int:
        return moe_parameters - 3 * self.hidden_size * self.ffn_size

    def block_parameters(self, layer: int) -> int:
        dense = super().block_parameters(layer)
        if not self.is_sparse(layer):
            return dense
        return dense + self._sparse_instead_of_dense(self.moe.layer_parameters(self.hidden_size))

    def blocks_parameters(self) -> int:
        sparse = self.moe.layer_parameters(self.hidden_size)
        return self.num_layers * super().block_parameters(0) + (self.num_layers - len(self.dense_layers)) * (
            self._sparse_instead_of_dense(sparse))

    def active_blocks_parameters(self) -> int:
        active = self.moe.active_layer_parameters(self.hidden_size)
        return self.num_layers * super().block_parameters(0) + (self.num_layers - len(self.dense_layers)) * (
            self._sparse_instead_of_dense(active))

    def architecture(self) -> dict[str, Any]:
        return {**super().architecture(), "moe": self.moe.architecture()}
