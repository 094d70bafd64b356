"""Llama block composition: pre-RMSNorm attention (RoPE, grouped kv heads, optional q/k/v biases) and SwiGLU.
`pre_norm_block` is the shape the Llama-like families (Qwen3, the MoE families) compose their parts into."""

from __future__ import annotations

from torch import nn

from fastlm.layers.attention import Attention
from fastlm.layers.block import DecoderBlock
from fastlm.layers.mlp import GatedMLP
from fastlm.layers.norm import build_norm
from fastlm.models.llama.config import LlamaConfig


def llama_attention(config: LlamaConfig, **options: object) -> Attention:
    return Attention(config.hidden_size, config.num_heads, config.kv_heads, qkv_bias=config.qkv_bias, out_bias=False,
                     dropout=config.dropout, head_dim=config.head_dim, norm_eps=config.norm_eps, **options)  # type: ignore[arg-type]


def swiglu(config: LlamaConfig) -> GatedMLP:
    return GatedMLP(config.hidden_size, config.ffn_size, "silu")


def pre_norm_block(config: LlamaConfig, attention: Attention, mlp: nn.Module) -> DecoderBlock:
    """x + attn(rmsnorm(x)), then x + mlp(rmsnorm(x))."""
    return DecoderBlock(build_norm("rmsnorm", config.hidden_size, config.norm_eps), attention,
                        build_norm("rmsnorm", config.hidden_size, config.norm_eps), mlp, config.dropout)


def llama_block(config: LlamaConfig, layer: int) -> DecoderBlock:
    return pre_norm_block(config, llama_attention(config), swiglu(config))
