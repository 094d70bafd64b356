"""Gemma 2 block composition: Gemma 3's sandwich of (1 + w) RMSNorms and GeGLU (tanh), no QK-norm,
attention scaled by query_pre_attn_scalar^-0.5 and its logits softcapped."""

from __future__ import annotations

from typing import Protocol

from fastlm.layers.block import DecoderBlock
from fastlm.layers.mlp import GatedMLP
from fastlm.layers.norm import build_norm
from fastlm.models.llama.blocks import LlamaShape, llama_attention


class Gemma2Shape(LlamaShape, Protocol):
    """What the Gemma 2 block reads of `Gemma2Config` beyond the Llama fields."""

    attn_logit_softcap: float | None

    @property
    def attention_scale(self) -> float: ...


def gemma2_block(config: Gemma2Shape, layer: int) -> DecoderBlock:
    def norm() -> object:
        return build_norm("rmsnorm_offset", config.hidden_size, config.norm_eps)

    attention = llama_attention(config, scale=config.attention_scale, softcap=config.attn_logit_softcap)
    return DecoderBlock(norm(), attention, norm(), GatedMLP(config.hidden_size, config.ffn_size, "gelu_tanh"),
                        config.dropout, post_attn_norm=norm(), post_mlp_norm=norm())
