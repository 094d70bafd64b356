"""`model.lora`: which linears get adapters, their rank, scale, dropout and initialisation. A field of every
model config (`DecoderConfig.lora`), so it sits in the models package; the adapters themselves are fastlm/lora."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from fastlm.config.base import ConfigModel


class LoraConfig(ConfigModel):
    """Low-rank adapters W + scale * B A on the frozen base's linears (PEFT's LoRA, same defaults where it has them).

    `targets` are module-name patterns (shell-style, matched against the end of a dotted name): fastlm's
    names such as `attn.q`, `attn.k`, `attn.v`, `attn.o`, `mlp.gate`, `mlp.up`, `mlp.down`, `mlp.*` (a
    fused qkv or gate/up projection gets one adapter per slice), PEFT's names such as `q_proj`, `o_proj`,
    `down_proj` or GPT-2's `c_attn`, layer-specific ones (`blocks.0.attn.*`), or `all-linear`.
    """

    rank: int = Field(16, ge=1, description="r: the adapters' inner dimension.")
    alpha: float = Field(32.0, gt=0.0, description="Scale numerator: scale = alpha / rank (alpha / sqrt(rank) with rslora).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input (training only).")
    targets: list[str] = Field(default_factory=lambda: ["all-linear"], min_length=1)
    rslora: bool = Field(False, description="Rank-stabilised scale alpha / sqrt(rank).")
    init: Literal["kaiming", "gaussian"] = Field(
        "kaiming", description="A's init (B starts at zero, so the model starts as the base): PEFT's default "
        "Kaiming-uniform, or Gaussian with std 1/rank.")
    train_head: bool = Field(False, description="Also train the untied output matrix in full (PEFT's modules_to_save lm_head).")
    frozen_experts: bool = Field(
        False, description="A mixture-of-experts model: train adapters although its routed experts get none (adapters "
        "sit on linears: attention, router, dense and shared-expert MLPs; the experts' stacked weights stay the "
        "base's). Without it, validation refuses LoRA on such a model, so the experts are never left out silently.")
    adapter_path: str | None = Field(
        None, description="Start the adapters from a PEFT adapter folder (adapter_config.json) or a "
        "`fastlm convert --from-peft` output, instead of B = 0.")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)
