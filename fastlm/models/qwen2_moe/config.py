"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases, optional per-layer windows) and
a sparse MLP (`moe:`) plus a SwiGLU shared expert behind a sigmoid gate (`shared_expert_size`) in every layer
but `dense_layers`, which keep a dense SwiGLU of `intermediate_size`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from fastlm.models.llama.config import LlamaConfig
from fastlm.models.moe_family import MoESettings, check_dense_layers, shared_expert_parameters

if TYPE_CHECKING:
    from torch import nn


class Qwen2MoeConfig(LlamaConfig):
    type: Literal["qwen2_moe"] = "qwen2_moe"  # type: ignore[assignment]
    qkv_bias: bool = True
    norm_eps: float = Field(1e-6, gt=0.0)
    moe: MoESettings = Field(default_factory=MoESettings)
    shared_expert_size: int | None = Field(None, ge=1, description="The gated shared expert's width (None: none).")
    dense_layers: list[int] = Field(default_factory=list, description="Layers with a dense MLP instead of experts.")

    @model_validator(mode="after")
    def _check_dense_layers(self) -> Qwen2MoeConfig:
        check_dense_layers(self.dense_layers, self.num_layers)
        return self

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers

    def build_block(self, layer: int) -> nn.Module:
        if not self.is_sparse(layer):
            return super().build_block(layer)
        from fastlm.models.llama.blocks import llama_attention, pre_norm_block

        return pre_norm_block(self, llama_attention(self), self.moe.build_with_shared_expert(self.hidden_size,
                                                                                             self.shared_expert_size))

    def _sparse_instead_of_dense(self, active: bool) -> int:
        routed = (self.moe.active_layer_parameters if active else self.moe.layer_parameters)(self.hidden_size)
        return routed + shared_expert_parameters(self.hidden_size, self.shared_expert_size) - (
            3 * self.hidden_size * self.ffn_size)

    def block_parameters(self, layer: int) -> int:
        dense = super().block_parameters(layer)
        return dense + self._sparse_instead_of_dense(False) if self.is_sparse(layer) else dense

    def _blocks(self, active: bool) -> int:
        sparse = self.num_layers - len(self.dense_layers)
        return self.num_layers * super().block_parameters(0) + sparse * self._sparse_instead_of_dense(active)

    def blocks_parameters(self) -> int:
        return self._blocks(active=False)

    def active_blocks_parameters(self) -> int:
        return self._blocks(active=True)

    def architecture(self) -> dict[str, Any]:
        return {**super().architecture(), "moe": self.moe.architecture()}
