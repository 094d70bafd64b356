"""Qwen3 family config: Llama plus a per-head RMSNorm on q and k before RoPE (QK-norm), head_dim
decoupled from hidden / heads (Qwen3-0.6B: 16 heads x 128 on a 1024 hidden), no q/k/v biases."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from fastlm.models.llama.config import LlamaConfig

if TYPE_CHECKING:
    from torch import nn


class Qwen3Config(LlamaConfig):
    type: Literal["qwen3"] = "qwen3"  # type: ignore[assignment]
    rope_theta: float = Field(1_000_000.0, gt=0.0)
    norm_eps: float = Field(1e-6, gt=0.0)

    @model_validator(mode="after")
    def _no_bias(self) -> Qwen3Config:
        if self.qkv_bias:
            raise ValueError("qwen3 has no q/k/v biases (qkv_bias must be false)")
        return self

    def build_block(self, layer: int) -> nn.Module:
        from fastlm.models.qwen3.blocks import qwen3_block

        return qwen3_block(self, layer)

    def block_parameters(self, layer: int) -> int:
        return super().block_parameters(layer) + 2 * (self.head_dim or 0)  # q_norm, k_norm
