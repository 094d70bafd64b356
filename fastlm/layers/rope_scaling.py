"""RoPE frequency scaling options (linear, llama3, yarn, longrope), as config: no torch here, so model configs can
hold them; `fastlm.layers.rotary` turns them into frequencies, the same way transformers'
`modeling_rope_utils` does."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from fastlm.config.base import ConfigModel


class RopeScaling(ConfigModel):
    """How the rotary frequencies are stretched past the pretraining context (hashable: layers group by it)."""

    model_config = ConfigDict(frozen=True)

    type: Literal["linear", "llama3", "yarn", "longrope"]
    factor: float = Field(gt=0.0, description="Context extension factor.")
    original_max_seq_len: int | None = Field(
        None, ge=1, description="llama3 / yarn / longrope: the pretraining context (HF original_max_position_embeddings).")
    low_freq_factor: float = Field(1.0, gt=0.0, description="llama3 only.")
    high_freq_factor: float = Field(4.0, gt=0.0, description="llama3 only.")
    beta_fast: float = Field(32.0, gt=0.0, description="yarn only.")
    beta_slow: float = Field(1.0, gt=0.0, description="yarn only.")
    attention_factor: float | None = Field(None, gt=0.0, description="yarn: cos/sin scale; default from factor.")
    mscale: float | None = Field(None, description="yarn only.")
    mscale_all_dim: float | None = Field(None, description="yarn only.")
    truncate: bool = Field(True, description="yarn: round the correction range to whole dimensions.")
    short_factor: tuple[float, ...] | None = Field(
        None, description="longrope: per-frequency divisors (head_dim / 2 of them) while a forward's positions stay "
                          "within original_max_seq_len.")
    long_factor: tuple[float, ...] | None = Field(
        None, description="longrope: the divisors once a forward's largest position passes original_max_seq_len.")

    @model_validator(mode="after")
    def _check(self) -> RopeScaling:
        if self.type in ("llama3", "yarn", "longrope") and self.original_max_seq_len is None:
            raise ValueError(f"rope_scaling type {self.type!r} needs original_max_seq_len (the pretraining context)")
        if self.type == "longrope" and (not self.short_factor or not self.long_factor
                                        or len(self.short_factor) != len(self.long_factor)):
            raise ValueError("rope_scaling type 'longrope' needs short_factor and long_factor of equal length "
                             "(head_dim / 2 each)")
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("rope_scaling.high_freq_factor must be larger than low_freq_factor")
        return self

    @property
    def cos_sin_scale(self) -> float:
        """The factor cos and sin are multiplied by (yarn's and longrope's attention temperature; 1 otherwise)."""
        if self.type not in ("yarn", "longrope"):
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.type == "longrope":  # LongRoPE's sqrt(1 + log(factor) / log(original context))
            assert self.original_max_seq_len is not None
            return 1.0 if self.factor <= 1 else math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_seq_len))
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
