"""Normalisation layers: LayerNorm with bias (GPT-2) or RMSNorm (Llama)."""

from __future__ import annotations

from typing import Literal

from torch import nn

NormKind = Literal["layernorm", "rmsnorm"]


def build_norm(kind: NormKind, hidden_size: int, eps: float) -> nn.Module:
    """Both kinds have `reset_parameters()` (weight 1, bias 0), which the decoder's init calls."""
    if kind == "layernorm":
        return nn.LayerNorm(hidden_size, eps=eps, bias=True)
    if kind == "rmsnorm":
        return nn.RMSNorm(hidden_size, eps=eps)
    raise ValueError(f"unknown norm kind {kind!r}; expected 'layernorm' or 'rmsnorm'")
