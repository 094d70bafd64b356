"""Qwen3.5 / Qwen3-Next block composition: (1 + w) RMSNorms around a token mixer (Gated DeltaNet or gated
full attention) and a feed-forward block (SwiGLU, or experts plus the sigmoid-gated shared expert)."""

from __future__ import annotations

from torch import nn

from fastlm.layers.block import DecoderBlock
from fastlm.layers.gated_attention import GatedAttention
from fastlm.layers.gated_deltanet import GatedDeltaNet
from fastlm.layers.mlp import GatedMLP
from fastlm.layers.norm import build_norm
from fastlm.models.qwen3_5.config import Qwen35Config


def token_mixer(config: Qwen35Config, layer: int) -> nn.Module:
    if not config.is_linear(layer):
        assert config.head_dim is not None
        return GatedAttention(config.hidden_size, config.num_heads, config.kv_heads, config.head_dim,
                              config.rotary_dim, config.norm_eps, config.dropout)
    linear = config.linear_attention
    return GatedDeltaNet(config.hidden_size, linear.key_heads, linear.value_heads, linear.key_head_dim,
                         linear.value_head_dim, linear.conv_kernel, config.norm_eps, config.fused_linear_projections,
                         linear.kernel)


def feed_forward(config: Qwen35Config, layer: int) -> nn.Module:
    if not config.is_sparse(layer):
        return GatedMLP(config.hidden_size, config.ffn_size, "silu")
    assert config.moe is not None
    return config.moe.build_with_shared_expert(config.hidden_size, config.shared_expert_size)


def qwen3_5_block(config: Qwen35Config, layer: int) -> DecoderBlock:
    def norm() -> nn.Module:
        return build_norm("rmsnorm_offset", config.hidden_size, config.norm_eps)

    return DecoderBlock(norm(), token_mixer(config, layer), norm(), feed_forward(config, layer),  # type: ignore[arg-type]
                        config.dropout)
