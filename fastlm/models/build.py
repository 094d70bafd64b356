"""Sizing a model from its config without allocating it: parameter counts, memory, FLOPs per token."""

from __future__ import annotations

import math

from torch import nn

from fastlm.models.config import GPT2Config, LlamaConfig, ModelConfig


def count_parameters(model: nn.Module) -> int:
    """Unique parameters of a built model (works on meta); `parameters()` yields a tied embedding once."""
    return sum(p.numel() for p in model.parameters())


def _layer_parameters(config: ModelConfig) -> int:
    """One decoder block, written out from the architecture (independent of the module code)."""
    hidden, ffn = config.hidden_size, config.ffn_size
    if isinstance(config, GPT2Config):
        norms = 2 * 2 * hidden  # two LayerNorms with weight and bias
        attention = hidden * 3 * hidden + 3 * hidden + hidden * hidden + hidden
        mlp = hidden * ffn + ffn + ffn * hidden + hidden
        return norms + attention + mlp
    kv_size = config.kv_heads * config.head_dim
    qkv_out = hidden + 2 * kv_size
    attention = hidden * qkv_out + (qkv_out if config.qkv_bias else 0) + hidden * hidden
    return 2 * hidden + attention + 3 * hidden * ffn  # two RMSNorm weights, SwiGLU gate/up/down


def _embedding_parameters(config: ModelConfig) -> int:
    """Token (+ learned position) embeddings and the untied output matrix, if any."""
    tokens = config.vocab_size * config.hidden_size
    positions = config.max_seq_len * config.hidden_size if isinstance(config, GPT2Config) else 0
    output = 0 if config.tie_embeddings else tokens
    return tokens + positions + output


def num_parameters(config: ModelConfig) -> int:
    """Analytic parameter count; must equal `count_parameters(build_model(config, "meta"))`."""
    final_norm = 2 * config.hidden_size if isinstance(config, GPT2Config) else config.hidden_size
    return config.num_layers * _layer_parameters(config) + _embedding_parameters(config) + final_norm


def describe_count(count: int) -> str:
    """A count for a message: digits with separators, or a power of ten when it is astronomically large
    (a float conversion overflows past 1e308 and a decimal string is refused past 4300 digits)."""
    return f"{count:,}" if count < 10**15 else f"about 10^{int(math.log10(count))}"


def estimate_memory(config: ModelConfig, bytes_per_value: int = 4) -> int:
    """Bytes for parameters + gradients + AdamW's two moments, all fp32 by default (16 bytes/param).

    Activations are not included: they depend on batch shape, precision and recomputation.
    """
    return 4 * bytes_per_value * num_parameters(config)


def model_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM appendix-B style:

        6 * N_matmul + 12 * num_layers * hidden_size * S_attn

    N_matmul counts the weights used in matmuls: all parameters except the input embeddings (a
    lookup costs no FLOPs), plus the output projection V*H (counted even when tied, since the head
    matmul runs either way). 12*L*H*S is the QK^T and AV products (2 * 2*S*H forward, x3 with the
    backward). S_attn = seq_len, or min(seq_len, sliding_window); like PaLM the causal halving is not
    applied, and packed documents are not taken into account.
    """
    embeddings = _embedding_parameters(config)
    n_matmul = num_parameters(config) - embeddings + config.vocab_size * config.hidden_size
    window = config.sliding_window if isinstance(config, LlamaConfig) else None
    span = min(seq_len, window) if window else seq_len
    return 6.0 * n_matmul + 12.0 * config.num_layers * config.hidden_size * span
