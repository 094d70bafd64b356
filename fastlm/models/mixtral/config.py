"""Mixtral: Llama/Mistral attention (RoPE, grouped kv heads, optional sliding window) and in every layer
a softmax top-k router over SwiGLU experts (`moe:`), its top-k renormalised."""

from __future__ import annotations

from typing import Literal

from fastlm.models.moe_family import SparseLlamaConfig


class MixtralConfig(SparseLlamaConfig):
    """Llama attention + a sparse MLP per layer; the experts' width is `moe.ffn_size`."""

    type: Literal["mixtral"] = "mixtral"  # type: ignore[assignment]
