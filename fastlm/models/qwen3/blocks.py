"""Qwen3 block composition: the Llama block with RMSNorm on each q and k head (before RoPE)."""

from __future__ import annotations

from fastlm.layers.attention import Attention
from fastlm.layers.block import DecoderBlock
from fastlm.models.llama.blocks import llama_attention, pre_norm_block, swiglu
from fastlm.models.qwen3.config import Qwen3Config


def qwen3_attention(config: Qwen3Config) -> Attention:
    return llama_attention(config, qk_norm="rmsnorm")


def qwen3_block(config: Qwen3Config, layer: int) -> DecoderBlock:
    return pre_norm_block(config, qwen3_attention(config), swiglu(config))
