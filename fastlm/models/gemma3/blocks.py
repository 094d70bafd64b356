"""Gemma 3 block composition: (1 + w) RMSNorm before and after attention and MLP (sandwich), QK-norm,
GeGLU (tanh), attention scaled by query_pre_attn_scalar^-0.5."""

from __future__ import annotations

from typing import Protocol

from fastlm.layers.block import DecoderBlock
from fastlm.layers.mlp import GatedMLP
from fastlm.layers.norm import build_norm
from fastlm.models.llama.blocks import LlamaShape, llama_attention


class Gemma3Shape(LlamaShape, Protocol):
    """What the Gemma 3 block reads of `Gemma3Config` beyond the Llama fields."""

    @property
    def attention_scale(self) -> float: ...


def gemma3_block(config: Gemma3Shape, layer: int) -> DecoderBlock:
    def norm() -> object:
        return build_norm("rmsnorm_offset", config.hidden_size, config.norm_eps)

    return DecoderBlock(norm(), llama_attention(config, qk_norm="rmsnorm_offset", scale=config.attention_scale),
                        norm(), GatedMLP(config.hidden_size, config.ffn_size, "gelu_tanh"), config.dropout,
                        post_attn_norm=norm(), post_mlp_norm=norm())
