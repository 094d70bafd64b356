"""Ministral family config: the Llama block (no biases) with a sliding window on the layers `layer_types`
lists (HF `ministral`: Qwen2's per-layer windows without Qwen2's q/k/v biases)."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from fastlm.models.llama.config import LlamaConfig


class MinistralConfig(LlamaConfig):
    type: Literal["ministral"] = "ministral"  # type: ignore[assignment]

    @model_validator(mode="after")
    def _no_bias(self) -> MinistralConfig:
        if self.qkv_bias:
            raise ValueError(f"{self.type} has no q/k/v biases (qkv_bias must be false)")
        return self
