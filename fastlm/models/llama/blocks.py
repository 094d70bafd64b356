"""Llama block composition: pre-RMSNorm attention (RoPE, grouped kv heads, optional q/k/v biases) and SwiGLU.
`pre_norm_block` is the shape the Llama-like families (Qwen3, the MoE families) compose their parts into.

A family's blocks.py reads its config through a protocol of what it reads, never its config module: that
module imports this one (lazily, in `build_block`) to build its blocks."""

from __future__ import annotations

from typing import Protocol

from torch import nn

from fastlm.layers.attention import Attention
from fastlm.layers.block import DecoderBlock
from fastlm.layers.mlp import GatedMLP
from fastlm.layers.norm import build_norm


class LlamaShape(Protocol):
    """What the Llama-like blocks read of a config (`LlamaConfig` and the families built on it)."""

    hidden_size: int
    num_heads: int
    head_dim: int | None
    qkv_bias: bool
    norm_eps: float
    dropout: float

    @property
    def kv_heads(self) -> int: ...
    @property
    def ffn_size(self) -> int: ...


def llama_attention(config: LlamaShape, **options: object) -> Attention:
    return Attention(config.hidden_size, config.num_heads, config.kv_heads, qkv_bias=config.qkv_bias, out_bias=False,
                     dropout=config.dropout, head_dim=config.head_dim, norm_eps=config.norm_eps, **options)  # type: ignore[arg-type]


def swiglu(config: LlamaShape) -> GatedMLP:
    return GatedMLP(config.hidden_size, config.ffn_size, "silu")


def pre_norm_block(config: LlamaShape, attention: Attention, mlp: nn.Module) -> DecoderBlock:
    """x + attn(rmsnorm(x)), then x + mlp(rmsnorm(x))."""
    return DecoderBlock(build_norm("rmsnorm", config.hidden_size, config.norm_eps), attention,
                        build_norm("rmsnorm", config.hidden_size, config.norm_eps), mlp, config.dropout)


def llama_block(config: LlamaShape, layer: int) -> DecoderBlock:
    return pre_norm_block(config, llama_attention(config), swiglu(config))
