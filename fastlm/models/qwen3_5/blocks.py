"""Qwen3.5 / Qwen3-Next block composition: (1 + w) RMSNorms around a token mixer (Gated DeltaNet or gated
full attention) and a feed-forward block (SwiGLU, or experts plus the sigmoid-gated shared expert)."""

from __future__ import annotations

from typing import Literal, Protocol

from torch import nn

from fastlm.layers.block import DecoderBlock
from fastlm.layers.gated_attention import GatedAttention
from fastlm.layers.gated_deltanet import GatedDeltaNet
from fastlm.layers.mlp import GatedMLP
from fastlm.layers.norm import build_norm
from fastlm.models.llama.blocks import LlamaShape
from fastlm.models.moe_family import MoESettings


class DeltaNetShape(Protocol):
    """What the Gated DeltaNet mixer reads of `LinearAttentionSettings`."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    kernel: Literal["auto", "fla", "torch"]


class Qwen35Shape(LlamaShape, Protocol):
    """What the Qwen3.5 block reads of `Qwen35Config` beyond the Llama fields."""

    linear_attention: DeltaNetShape
    fused_linear_projections: bool
    moe: MoESettings | None
    shared_expert_size: int | None

    @property
    def rotary_dim(self) -> int: ...
    def is_linear(self, layer: int) -> bool: ...
    def is_sparse(self, layer: int) -> bool: ...


def token_mixer(config: Qwen35Shape, layer: int) -> nn.Module:
    if not config.is_linear(layer):
        assert config.head_dim is not None
        return GatedAttention(config.hidden_size, config.num_heads, config.kv_heads, config.head_dim,
                              config.rotary_dim, config.norm_eps, config.dropout)
    linear = config.linear_attention
    return GatedDeltaNet(config.hidden_size, linear.key_heads, linear.value_heads, linear.key_head_dim,
                         linear.value_head_dim, linear.conv_kernel, config.norm_eps, config.fused_linear_projections,
                         linear.kernel)


def feed_forward(config: Qwen35Shape, layer: int) -> nn.Module:
    if not config.is_sparse(layer):
        return GatedMLP(config.hidden_size, config.ffn_size, "silu")
    assert config.moe is not None
    return config.moe.build_with_shared_expert(config.hidden_size, config.shared_expert_size)


def qwen3_5_block(config: Qwen35Shape, layer: int) -> DecoderBlock:
    def norm() -> nn.Module:
        return build_norm("rmsnorm_offset", config.hidden_size, config.norm_eps)

    return DecoderBlock(norm(), token_mixer(config, layer), norm(), feed_forward(config, layer),  # type: ignore[arg-type]
                        config.dropout)
