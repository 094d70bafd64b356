"""OLMoE: Llama attention whose q and k projections are RMS-normalised over their full width (all heads
together, before RoPE), and in every layer a softmax top-k router over SwiGLU experts (`moe:`; OLMoE-1B-7B
does not renormalise the top-k)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from fastlm.models.moe_family import MoESettings, SparseLlamaConfig

if TYPE_CHECKING:
    from torch import nn


class OlmoeConfig(SparseLlamaConfig):
    """Llama attention + full-width QK-norm + a sparse MLP per layer; the experts' width is `moe.ffn_size`."""

    type: Literal["olmoe"] = "olmoe"  # type: ignore[assignment]
    moe: MoESettings = Field(default_factory=lambda: MoESettings(normalize_top_k=False))

    def build_block(self, layer: int) -> nn.Module:
        from fastlm.models.llama.blocks import llama_attention, pre_norm_block

        attention = llama_attention(self, qk_norm="rmsnorm", qk_norm_per_head=False)
        return pre_norm_block(self, attention, self.moe.build(self.hidden_size))

    def attention_parameters(self) -> int:
        """Llama's, plus the q and k norms' weights (full width)."""
        head_dim = self.head_dim or 0
        return super().attention_parameters() + (self.num_heads + self.kv_heads) * head_dim
