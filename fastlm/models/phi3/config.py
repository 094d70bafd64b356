"""Phi-3 family config: the Llama block (SwiGLU, RoPE, grouped kv heads) with HF's fused qkv and gate_up
weights, an optional sliding window on every layer, head_dim = hidden / heads, no biases."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fastlm.models.llama.config import LlamaConfig


class Phi3Config(LlamaConfig):
    type: Literal["phi3"] = "phi3"  # type: ignore[assignment]

    norm_eps: float = Field(1e-5, gt=0.0)

    @model_validator(mode="after")
    def _phi3_shape(self) -> Phi3Config:
        if self.qkv_bias:
            raise ValueError("phi3 has no q/k/v biases (qkv_bias must be false)")
        if self.layer_types is not None:
            raise ValueError("phi3 applies its sliding_window to every layer; leave layer_types unset")
        if (self.head_dim or 0) * self.num_heads != self.hidden_size:
            raise ValueError(f"phi3 has head_dim = hidden_size / num_heads = {self.hidden_size // self.num_heads}")
        return self
