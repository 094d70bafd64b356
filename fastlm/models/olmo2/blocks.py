"""OLMo 2 block composition: x + rmsnorm(attn(x)), then x + rmsnorm(swiglu(x)); the attention's q and k
RMS-normalised over their full width."""

from __future__ import annotations

from fastlm.layers.block import DecoderBlock
from fastlm.layers.norm import build_norm
from fastlm.models.llama.blocks import LlamaShape, llama_attention, swiglu


def olmo2_block(config: LlamaShape, layer: int) -> DecoderBlock:
    attention = llama_attention(config, qk_norm="rmsnorm", qk_norm_per_head=False)
    return DecoderBlock(None, attention, None, swiglu(config), config.dropout,
                        post_attn_norm=build_norm("rmsnorm", config.hidden_size, config.norm_eps),
                        post_mlp_norm=build_norm("rmsnorm", config.hidden_size, config.norm_eps))
