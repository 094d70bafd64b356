"""Llama family config: RMSNorm, RoPE (optionally scaled), grouped-query attention, SwiGLU. Options:
q/k/v biases (Qwen2), a sliding window on every layer (Mistral) or on some (`layer_types`, Qwen2's
max_window_layers), a head_dim decoupled from hidden / heads. Qwen3, Phi-3 and Gemma 3 build on it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, model_validator

from fastlm.layers.rope_scaling import RopeScaling
from fastlm.models.base import DecoderConfig, LayerAttention, Rope

if TYPE_CHECKING:
    from torch import nn

LayerType = Literal["full_attention", "sliding_attention"]


class LlamaConfig(DecoderConfig):
    """RMSNorm, RoPE, grouped-query attention, SwiGLU; qkv_bias (Qwen2) and sliding_window (Mistral) optional."""

    type: Literal["llama"] = "llama"
    num_kv_heads: int | None = Field(None, ge=1, description="Defaults to num_heads (no grouping).")
    intermediate_size: int | None = Field(None, ge=1, description="Defaults to about 8/3 * hidden_size, rounded to 64.")
    rope_theta: float = Field(10000.0, gt=0.0)
    rope_scaling: RopeScaling | None = Field(None, description="linear / llama3 / yarn frequency scaling.")
    qkv_bias: bool = False
    sliding_window: int | None = Field(None, ge=1)
    layer_types: list[LayerType] | None = Field(
        None, description="Per layer: full_attention or sliding_attention (uses sliding_window). "
                          "None: every layer slides when sliding_window is set.")
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
    def _check_attention(self) -> LlamaConfig:
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.kv_heads}; "
                "grouped-query attention needs num_heads = k * num_kv_heads"
            )
        if (self.head_dim or 0) % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries; it needs one per layer "
                                 f"(num_layers = {self.num_layers})")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        return self

    # Without layer_types, which layers slide: all (None), or all but every `global_every`-th (Gemma, OLMo 3, GPT-OSS)
    global_every: ClassVar[int | None] = None

    # --- family interface --------------------------------------------------------------------------
    def is_sliding(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        if self.layer_types is not None:
            return self.layer_types[layer] == "sliding_attention"
        return self.global_every is None or (layer + 1) % self.global_every != 0

    def layer_attention(self, layer: int) -> LayerAttention:
        return LayerAttention(self.sliding_window if self.is_sliding(layer) else None,
                              Rope(self.rope_theta, self.rope_scaling))

    def build_block(self, layer: int) -> nn.Module:
        from fastlm.models.llama.blocks import llama_block

        return llama_block(self, layer)

    def build_final_norm(self) -> nn.Module:
        from fastlm.layers.norm import build_norm

        return build_norm("rmsnorm", self.hidden_size, self.norm_eps)

    def attention_parameters(self) -> int:
        """qkv (+ biases) and the output projection."""
        q_size, kv_size = self.num_heads * (self.head_dim or 0), self.kv_heads * (self.head_dim or 0)
        qkv_out = q_size + 2 * kv_size
        return self.hidden_size * qkv_out + (qkv_out if self.qkv_bias else 0) + q_size * self.hidden_size

    def block_parameters(self, layer: int) -> int:
        return 2 * self.hidden_size + self.attention_parameters() + 3 * self.hidden_size * self.ffn_size

    def final_norm_parameters(self) -> int:
        return self.hidden_size

    def architecture(self) -> dict[str, Any]:
        values = {**super().architecture(), "num_kv_heads": self.kv_heads}
        kinds = set(self.layer_types or ())
        if len(kinds) == 1:  # one kind for every layer: the same model as no list
            values["layer_types"] = None
            values["sliding_window"] = self.sliding_window if kinds == {"sliding_attention"} else None
        return values
