"""GPT-OSS family config: pre-RMSNorm blocks of grouped-query attention with q/k/v/o biases and a learned
sink logit per head (in every softmax denominator), sliding-window and global layers alternating, yarn
RoPE, and in every layer a mixture of experts: a biased router (softmax over the top-k logits) and experts
with biases and the clamped SwiGLU (`clamped_swiglu`: alpha, limit)."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from fastlm.models.moe_family import MoESettings, SparseLlamaConfig

if TYPE_CHECKING:
    from torch import nn

    from fastlm.layers.moe import MoEMLP

SLIDING_EVERY = 2  # without layer_types, layers 0, 2, 4, ... slide (transformers' GPT-OSS default)


class GptOssMoESettings(MoESettings):
    """The sparse MLP with GPT-OSS's router bias, expert biases and clamped SwiGLU."""

    normalize_top_k: bool = Field(True, description="GPT-OSS takes the softmax over the top-k logits (renormalised).")
    aux_loss_coef: float = Field(0.001, ge=0.0)
    swiglu_alpha: float = Field(1.702, gt=0.0, description="The gate's sigmoid slope.")
    swiglu_limit: float = Field(7.0, gt=0.0, description="The gate is clamped to at most it, up to [-limit, limit].")

    def build(self, hidden_size: int) -> MoEMLP:
        from fastlm.layers.moe import MoEMLP, clamped_swiglu

        return MoEMLP(hidden_size, self.ffn_size, self.num_experts, self.top_k, self.normalize_top_k,
                      backend=self.backend, aux_loss_coef=self.aux_loss_coef, z_loss_coef=self.z_loss_coef,
                      router_bias=True, expert_bias=True,
                      activation=partial(clamped_swiglu, alpha=self.swiglu_alpha, limit=self.swiglu_limit))

    def architecture(self) -> dict[str, Any]:
        return {**super().architecture(), "swiglu_alpha": self.swiglu_alpha, "swiglu_limit": self.swiglu_limit}

    def _biases(self, hidden_size: int, experts: int) -> int:
        return self.num_experts + experts * (2 * self.ffn_size + hidden_size)  # router bias, experts' biases

    def layer_parameters(self, hidden_size: int) -> int:
        return super().layer_parameters(hidden_size) + self._biases(hidden_size, self.num_experts)

    def active_layer_parameters(self, hidden_size: int) -> int:
        return super().active_layer_parameters(hidden_size) + self._biases(hidden_size, self.top_k)


class GptOssConfig(SparseLlamaConfig):
    type: Literal["gpt_oss"] = "gpt_oss"  # type: ignore[assignment]
    qkv_bias: bool = True
    rope_theta: float = Field(150_000.0, gt=0.0)
    moe: GptOssMoESettings = Field(default_factory=GptOssMoESettings)

    global_every: ClassVar[int | None] = SLIDING_EVERY

    def build_block(self, layer: int) -> nn.Module:
        from fastlm.layers.attention import Attention
        from fastlm.models.llama.blocks import pre_norm_block

        attention = Attention(self.hidden_size, self.num_heads, self.kv_heads, qkv_bias=self.qkv_bias,
                              out_bias=self.qkv_bias, dropout=self.dropout, head_dim=self.head_dim, sinks=True)
        return pre_norm_block(self, attention, self.moe.build(self.hidden_size))

    def attention_parameters(self) -> int:
        """Llama's, plus the output bias (with the q/k/v ones) and a sink per head."""
        return super().attention_parameters() + (self.hidden_size if self.qkv_bias else 0) + self.num_heads

    def architecture(self) -> dict[str, Any]:
        values = super().architecture()
        values["layer_types"] = ["sliding_attention" if self.is_sliding(layer) else "full_attention"
                                 for layer in range(self.num_layers)]
        values["sliding_window"] = self.sliding_window if "sliding_attention" in values["layer_types"] else None
        return values
