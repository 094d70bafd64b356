"""DeepSeek-V3 family config (DeepSeek-V3/R1, Moonlight, Kimi-K2: transformers' `deepseek_v3`): multi-head
latent attention (`fastlm/layers/latent_attention.py`), a dense SwiGLU MLP in the first
`first_k_dense_replace` layers, then experts routed by sigmoid scores with the correction bias and
group-limited top-k (`fastlm/layers/sigmoid_router.py`) beside `n_shared_experts` always-on experts
(`fastlm/layers/shared_expert.py`). `head_dim` is the rotary width (qk_rope_head_dim), as in transformers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from fastlm.layers.rope_scaling import RopeScaling, yarn_mscale
from fastlm.models.base import DecoderConfig, LayerAttention, Rope
from fastlm.models.moe_family import MoESettings

if TYPE_CHECKING:
    from torch import nn


class DeepseekMoESettings(MoESettings):
    """`moe:` of DeepSeek-V3: the routed experts, the shared ones and the router's groups and scale."""

    n_shared_experts: int = Field(1, ge=0, description="Always-on experts, one SwiGLU of n * ffn_size.")
    n_group: int = Field(1, ge=1, description="Expert groups of the group-limited top-k.")
    topk_group: int = Field(1, ge=1, description="Groups a token's experts may come from.")
    routed_scaling_factor: float = Field(1.0, gt=0.0, description="Factor on the routed experts' weights.")
    aux_loss_coef: float = Field(0.0, ge=0.0, description="DeepSeek-V3 balances through its correction bias "
                                                          "(noaux_tc), not a loss: 0 by default.")

    @model_validator(mode="after")
    def _check_groups(self) -> DeepseekMoESettings:
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError(f"num_experts {self.num_experts} must split into n_group {self.n_group} groups, "
                             f"topk_group {self.topk_group} <= n_group")
        return self

    def build(self, hidden_size: int) -> nn.Module:
        from fastlm.layers.mlp import GatedMLP
        from fastlm.layers.shared_expert import SharedExpertMLP
        from fastlm.layers.sigmoid_router import SigmoidRouterMoE

        routed = SigmoidRouterMoE(hidden_size, self.ffn_size, self.num_experts, self.top_k, self.normalize_top_k,
                                  backend=self.backend, aux_loss_coef=self.aux_loss_coef,
                                  z_loss_coef=self.z_loss_coef, n_group=self.n_group, topk_group=self.topk_group,
                                  routed_scaling_factor=self.routed_scaling_factor)
        return SharedExpertMLP(routed, GatedMLP(hidden_size, self.n_shared_experts * self.ffn_size), None)

    def architecture(self) -> dict[str, Any]:
        return self.model_dump(include={"num_experts", "top_k", "ffn_size", "normalize_top_k", "n_shared_experts",
                                        "n_group", "topk_group", "routed_scaling_factor"})

    def layer_parameters(self, hidden_size: int) -> int:
        """Router, its correction bias, routed and shared experts."""
        return super().layer_parameters(hidden_size) + self.num_experts + self._shared(hidden_size)

    def active_layer_parameters(self, hidden_size: int) -> int:
        return super().active_layer_parameters(hidden_size) + self.num_experts + self._shared(hidden_size)

    def _shared(self, hidden_size: int) -> int:
        return 3 * hidden_size * self.n_shared_experts * self.ffn_size


class DeepseekV3Config(DecoderConfig):
    type: Literal["deepseek_v3"] = "deepseek_v3"
    q_lora_rank: int | None = Field(None, ge=1, description="Query latent width; None: a full q_proj.")
    kv_lora_rank: int = Field(64, ge=1, description="The compressed key/value latent width (what the cache holds).")
    qk_nope_head_dim: int = Field(32, ge=1)
    qk_rope_head_dim: int = Field(16, ge=2, description="The decoupled rotary key/query part (head_dim).")
    v_head_dim: int = Field(32, ge=1)
    intermediate_size: int = Field(256, ge=1, description="The dense MLP of the first_k_dense_replace layers.")
    first_k_dense_replace: int = Field(1, ge=0, description="Leading layers with a dense MLP.")
    moe: DeepseekMoESettings = Field(default_factory=DeepseekMoESettings)
    rope_theta: float = Field(10000.0, gt=0.0)
    rope_scaling: RopeScaling | None = None
    rope_interleave: bool = Field(True, description="The rotary dims in interleaved pairs (DeepSeek's checkpoints).")
    tie_embeddings: bool = False
    norm_eps: float = Field(1e-6, gt=0.0)

    @model_validator(mode="before")
    @classmethod
    def _head_dim_is_rotary(cls, data: Any) -> Any:
        if isinstance(data, dict):
            rope = data.get("qk_rope_head_dim", cls.model_fields["qk_rope_head_dim"].default)
            data = {**data, "head_dim": rope}
        return data

    @model_validator(mode="after")
    def _check(self) -> DeepseekV3Config:
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even for rotary embeddings")
        if self.first_k_dense_replace > self.num_layers:
            raise ValueError(f"first_k_dense_replace {self.first_k_dense_replace} > num_layers {self.num_layers}")
        return self

    # --- family interface --------------------------------------------------------------------------
    @property
    def ffn_size(self) -> int:
        return self.intermediate_size

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def attention_scale(self) -> float:
        """qk_head_dim^-0.5, times yarn's mscale(factor, mscale_all_dim)^2 (transformers' yarn_apply_mscale)."""
        scale = self.qk_head_dim ** -0.5
        scaling = self.rope_scaling
        if scaling is not None and scaling.type == "yarn" and scaling.mscale_all_dim:
            mscale = yarn_mscale(scaling.factor, scaling.mscale_all_dim)
            scale = scale * mscale * mscale
        return scale

    def kv_cache_shape(self) -> tuple[int, int, int | None]:
        """One latent row per token: [c (kv_lora_rank), rotated shared key], the values its first columns."""
        return 1, self.kv_lora_rank + self.qk_rope_head_dim, self.kv_lora_rank

    def is_sparse(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def layer_attention(self, layer: int) -> LayerAttention:
        return LayerAttention(None, Rope(self.rope_theta, self.rope_scaling))

    def build_block(self, layer: int) -> nn.Module:
        from fastlm.layers.block import DecoderBlock
        from fastlm.layers.latent_attention import LatentAttention
        from fastlm.layers.mlp import GatedMLP
        from fastlm.layers.norm import build_norm

        attention = LatentAttention(self.hidden_size, self.num_heads, self.q_lora_rank, self.kv_lora_rank,
                                    self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim,
                                    self.attention_scale, self.rope_interleave, self.dropout)
        mlp = self.moe.build(self.hidden_size) if self.is_sparse(layer) else GatedMLP(self.hidden_size, self.ffn_size)
        return DecoderBlock(build_norm("rmsnorm", self.hidden_size, self.norm_eps), attention,  # type: ignore[arg-type]
                            build_norm("rmsnorm", self.hidden_size, self.norm_eps), mlp, self.dropout)

    def build_final_norm(self) -> nn.Module:
        from fastlm.layers.norm import build_norm

        return build_norm("rmsnorm", self.hidden_size, self.norm_eps)

    def attention_parameters(self) -> int:
        hidden, heads = self.hidden_size, self.num_heads
        q_width = heads * self.qk_head_dim
        q = hidden * q_width if self.q_lora_rank is None else (
            hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * q_width)
        kv = hidden * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank + \
            self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * hidden

    def _block(self, mlp: int) -> int:
        return 2 * self.hidden_size + self.attention_parameters() + mlp

    def block_parameters(self, layer: int) -> int:
        return self._block(self.moe.layer_parameters(self.hidden_size) if self.is_sparse(layer)
                           else 3 * self.hidden_size * self.ffn_size)

    def blocks_parameters(self) -> int:
        dense = self.first_k_dense_replace
        return dense * self.block_parameters(0) + (self.num_layers - dense) * self.block_parameters(self.num_layers - 1)

    def active_blocks_parameters(self) -> int:
        dense = self.first_k_dense_replace
        return dense * self.block_parameters(0) + (self.num_layers - dense) * self._block(
            self.moe.active_layer_parameters(self.hidden_size))

    def final_norm_parameters(self) -> int:
        return self.hidden_size

    def attention_flops_per_token(self, seq_len: int) -> float:
        """As the base's 12 * width * span, with QK^T over qk_head_dim and AV over v_head_dim per head."""
        return 6.0 * self.num_heads * (self.qk_head_dim + self.v_head_dim) * seq_len * self.num_layers

    def architecture(self) -> dict[str, Any]:
        return {**super().architecture(), "moe": self.moe.architecture()}
