"""OLMo 2 family config: Llama attention and SwiGLU with the norms after them instead of before
(x + norm(attn(x)), x + norm(mlp(x))), and RMSNorm over the full width of q and of k (all heads together,
before RoPE)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from fastlm.models.llama.config import LlamaConfig

if TYPE_CHECKING:
    from torch import nn


class Olmo2Config(LlamaConfig):
    type: Literal["olmo2"] = "olmo2"  # type: ignore[assignment]
    rope_theta: float = Field(500_000.0, gt=0.0)
    norm_eps: float = Field(1e-6, gt=0.0)

    def build_block(self, layer: int) -> nn.Module:
        from fastlm.models.olmo2.blocks import olmo2_block

        return olmo2_block(self, layer)

    def block_parameters(self, layer: int) -> int:
        # two post norms, q_norm (all q heads) and k_norm (all kv heads)
        head_dim = self.head_dim or 0
        return (2 * self.hidden_size + (self.num_heads + self.kv_heads) * head_dim + self.attention_parameters()
                + 3 * self.hidden_size * self.ffn_size)
