"""Decoder architectures, discriminated by `type:`. Qwen2 and Mistral are Llama with options."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from fastlm.config.base import ConfigModel
from fastlm.lora.config import LoraConfig
from fastlm.losses.config import LMHeadConfig


class DecoderConfig(ConfigModel):
    """What every decoder shares."""

    vocab_size: int = Field(260, ge=2, description="Must cover the tokenizer (byte tokenizer: 260).")
    hidden_size: int = Field(128, ge=1)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    max_seq_len: int = Field(256, ge=1)
    tie_embeddings: bool = True
    init_std: float = Field(0.02, gt=0.0)
    norm_eps: float = Field(1e-5, gt=0.0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    head: LMHeadConfig = Field(default_factory=LMHeadConfig)
    lora: LoraConfig | None = Field(None, description="Train low-rank adapters on a frozen base (fastlm/lora).")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @model_validator(mode="after")
    def _check_heads(self) -> "DecoderConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}; "
                "pick num_heads that divides hidden_size"
            )
        return self


class GPT2Config(DecoderConfig):
    """LayerNorm, learned positions, GELU MLP, biases everywhere."""

    type: Literal["gpt2"] = "gpt2"
    intermediate_size: int | None = Field(None, ge=1, description="Defaults to 4 * hidden_size.")

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size or 4 * self.hidden_size


class LlamaConfig(DecoderConfig):
    """RMSNorm, RoPE, grouped-query attention, SwiGLU; qkv_bias (Qwen2) and sliding_window (Mistral) optional."""

    type: Literal["llama"] = "llama"
    num_kv_heads: int | None = Field(None, ge=1, description="Defaults to num_heads (no grouping).")
    intermediate_size: int | None = Field(None, ge=1, description="Defaults to about 8/3 * hidden_size, rounded to 64.")
    rope_theta: float = Field(10000.0, gt=0.0)
    qkv_bias: bool = False
    sliding_window: int | None = Field(None, ge=1)
    tie_embeddings: bool = False

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def ffn_size(self) -> int:
        if self.intermediate_size:
            return self.intermediate_size
        return max(64, (int(8 * self.hidden_size / 3) + 63) // 64 * 64)

    @model_validator(mode="after")
    def _check_kv_heads(self) -> "LlamaConfig":
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.kv_heads}; "
                "grouped-query attention needs num_heads = k * num_kv_heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        return self


ModelConfig = Annotated[Union[GPT2Config, LlamaConfig], Field(discriminator="type")]
