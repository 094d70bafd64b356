"""GPT-2 block composition: pre-LayerNorm, multi-head attention with biases (no RoPE), GELU MLP."""

from __future__ import annotations

from fastlm.layers.attention import Attention
from fastlm.layers.block import DecoderBlock
from fastlm.layers.mlp import GeluMLP
from fastlm.layers.norm import build_norm
from fastlm.models.base import DecoderConfig


def gpt2_block(config: DecoderConfig) -> DecoderBlock:
    hidden = config.hidden_size
    attention = Attention(hidden, config.num_heads, config.num_heads, qkv_bias=True, out_bias=True,
                          dropout=config.dropout)
    return DecoderBlock(build_norm("layernorm", hidden, config.norm_eps), attention,
                        build_norm("layernorm", hidden, config.norm_eps), GeluMLP(hidden, config.ffn_size),
                        config.dropout)
