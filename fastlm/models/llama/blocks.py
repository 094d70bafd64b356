"""Llama block composition: pre-RMSNorm attention (RoPE, grouped kv heads, optional q/k/v biases) and SwiGLU."""

from __future__ import annotations

from fastlm.layers.attention import Attention
from fastlm.layers.block import DecoderBlock
from fastlm.layers.mlp import GatedMLP
from fastlm.layers.norm import build_norm
from fastlm.models.llama.config import LlamaConfig


def llama_attention(config: LlamaConfig, **options: object) -> Attention:
    return Attention(config.hidden_size, config.num_heads, config.kv_heads, qkv_bias=config.qkv_bias, out_bias=False,
                     dropout=config.dropout, head_dim=config.head_dim, norm_eps=config.norm_eps, **options)  # type: ignore[arg-type]


def llama_block(config: LlamaConfig, layer: int) -> DecoderBlock:
    return DecoderBlock(build_norm("rmsnorm", config.hidden_size, config.norm_eps), llama_attention(config),
                        build_norm("rmsnorm", config.hidden_size, config.norm_eps),
                        GatedMLP(config.hidden_size, config.ffn_size, "silu"), config.dropout)
