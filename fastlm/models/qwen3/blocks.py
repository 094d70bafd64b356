"""Qwen3 block composition: the Llama block with RMSNorm on each q and k head (before RoPE)."""

from __future__ import annotations

from fastlm.layers.attention import Attention
from fastlm.layers.block import DecoderBlock
from fastlm.models.llama.blocks import LlamaShape, llama_attention, pre_norm_block, swiglu


def qwen3_attention(config: LlamaShape) -> Attention:
    return llama_attention(config, qk_norm="rmsnorm")


def qwen3_block(config: LlamaShape, layer: int) -> DecoderBlock:
    return pre_norm_block(config, qwen3_attention(config), swiglu(config))
