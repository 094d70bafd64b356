"""GPT-2 family config: LayerNorm, learned positions, GELU MLP, biases everywhere."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from fastlm.models.base import DecoderConfig, LayerAttention

if TYPE_CHECKING:
    from torch import nn


class GPT2Config(DecoderConfig):
    """LayerNorm, learned positions, GELU MLP, biases everywhere."""

    type: Literal["gpt2"] = "gpt2"
    intermediate_size: int | None = Field(None, ge=1, description="Defaults to 4 * hidden_size.")

    NOT_ARCHITECTURE = DecoderConfig.NOT_ARCHITECTURE - {"max_seq_len"}  # the position table's rows

    @model_validator(mode="after")
    def _check_head_dim(self) -> GPT2Config:
        if self.head_dim is not None and self.head_dim * self.num_heads != self.hidden_size:
            raise ValueError(f"GPT-2 has head_dim = hidden_size / num_heads = {self.hidden_size // self.num_heads}; "
                             f"got head_dim {self.head_dim}")
        return self

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size or 4 * self.hidden_size

    @property
    def learned_positions(self) -> int | None:
        return self.max_seq_len

    def layer_attention(self, layer: int) -> LayerAttention:
        return LayerAttention(window=None, rope=None)

    def build_block(self, layer: int) -> nn.Module:
        from fastlm.models.gpt2.blocks import gpt2_block

        return gpt2_block(self)

    def build_final_norm(self) -> nn.Module:
        from fastlm.layers.norm import build_norm

        return build_norm("layernorm", self.hidden_size, self.norm_eps)

    def block_parameters(self, layer: int) -> int:
        hidden, ffn = self.hidden_size, self.ffn_size
        norms = 2 * 2 * hidden  # two LayerNorms with weight and bias
        attention = hidden * 3 * hidden + 3 * hidden + hidden * hidden + hidden
        mlp = hidden * ffn + ffn + ffn * hidden + hidden
        return norms + attention + mlp

    def final_norm_parameters(self) -> int:
        return 2 * self.hidden_size
