"""Sizing a model from its config without allocating it: parameter counts, memory, FLOPs per token."""

from __future__ import annotations

import math

from torch import nn

from fastlm.models.config import ModelConfig


def count_parameters(model: nn.Module) -> int:
    """Unique parameters of a built model (works on meta); `parameters()` yields a tied embedding once."""
    return sum(p.numel() for p in model.parameters())


def num_parameters(config: ModelConfig) -> int:
    """Analytic parameter count (the family's sizing); must equal `count_parameters(build_model(config, "meta"))`."""
    return config.blocks_parameters() + config.embedding_parameters() + config.final_norm_parameters()


def active_parameters(config: ModelConfig) -> int:
    """Parameters one token uses (all of them in a dense model; a mixture of experts counts its top-k)."""
    return config.active_blocks_parameters() + config.embedding_parameters() + config.final_norm_parameters()


def describe_count(count: int) -> str:
    """A count for a message: digits with separators, or a power of ten when it is astronomically large
    (a float conversion overflows past 1e308 and a decimal string is refused past 4300 digits)."""
    return f"{count:,}" if count < 10**15 else f"about 10^{int(math.log10(count))}"


def model_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM appendix-B style:

        6 * N_matmul + attention (12 * (heads * head_dim) * span per layer)

    N_matmul counts the weights a token's forward multiplies by: the blocks' (a mixture of experts counts
    the routed experts only: `active_blocks_parameters`) and the final norm, not the input embeddings (a
    lookup costs no FLOPs), plus the output projection V*H (counted even when tied, since the head
    matmul runs either way). The attention term is the QK^T and AV products with span = seq_len, or the
    layer's sliding window when shorter (`DecoderConfig.attention_flops_per_token`).
    """
    n_matmul = config.active_blocks_parameters() + config.final_norm_parameters() + config.vocab_size * config.hidden_size
    return 6.0 * n_matmul + config.attention_flops_per_token(seq_len)
