"""Qwen3 block composition: the Llama block with RMSNorm on each q and k head (before RoPE)."""

from __future__ import annotations

from fastlm.layers.block import DecoderBlock
from fastlm.layers.mlp import GatedMLP
from fastlm.layers.norm import build_norm
from fastlm.models.llama.blocks import llama_attention
from fastlm.models.qwen3.config import Qwen3Config


def qwen3_block(config: Qwen3Config, layer: int) -> DecoderBlock:
    return DecoderBlock(build_norm("rmsnorm", config.hidden_size, config.norm_eps),
                        llama_attention(config, qk_norm="rmsnorm"),
                        build_norm("rmsnorm", config.hidden_size, config.norm_eps),
                        GatedMLP(config.hidden_size, config.ffn_size, "silu"), config.dropout)
