"""Qwen3.5 / Qwen3-Next family config: a hybrid stack of Gated DeltaNet linear-attention layers and gated
full-attention layers (by default every `full_attention_interval`-th layer is full attention, or per layer
in `layer_types`), (1 + w) RMSNorms, partial RoPE, and a dense SwiGLU or a mixture of experts with a gated
shared expert in each layer.

How a hybrid stack is declared: `layer_types` lists each layer's token mixer (`linear_attention` or
`full_attention`); left out, layer i is full attention when (i + 1) % full_attention_interval == 0 (HF's
rule). The family's `layer_attention` gives the full layers their rotary embedding (the decoder builds it
once), `build_block` picks the mixer, and `recurrent_state` tells the generator's cache what a linear layer
keeps instead of keys and values. Multi-token-prediction layers (`mtp.*`) are not part of this model:
import drops them (fastlm trains and decodes the main model only)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from fastlm.config.base import ConfigModel
from fastlm.config.errors import ConfigIssue
from fastlm.models.base import LayerAttention, Rope, rotary_width
from fastlm.models.llama.config import LlamaConfig
from fastlm.models.moe_family import MoESettings, check_dense_layers, shared_expert_parameters

if TYPE_CHECKING:
    from torch import nn

    from fastlm.layers.kv_cache import RecurrentShape

MixerType = Literal["linear_attention", "full_attention"]
DELTA_CHUNK = 64  # the chunked rule's chunk (FLOPs estimate)


class LinearAttentionSettings(ConfigModel):
    """The Gated DeltaNet layers (HF linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
    linear_value_head_dim, linear_conv_kernel_dim)."""

    key_heads: int = Field(16, ge=1)
    value_heads: int = Field(32, ge=1)
    key_head_dim: int = Field(128, ge=1)
    value_head_dim: int = Field(128, ge=1)
    conv_kernel: int = Field(4, ge=1)
    kernel: Literal["auto", "fla", "torch"] = Field(
        "auto", description="The chunked rule: fla (fla-core's Triton kernel, CUDA), torch (PyTorch), auto: fla "
                            "on CUDA when installed, else torch.")

    @model_validator(mode="after")
    def _check_heads(self) -> LinearAttentionSettings:
        if self.value_heads % self.key_heads:
            raise ValueError(f"value_heads {self.value_heads} must be a multiple of key_heads {self.key_heads}")
        return self

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim

    def parameters(self, hidden_size: int) -> int:
        """qkv, z, b, a projections, conv, A_log, dt_bias, the gated norm and the out projection."""
        value_dim = self.value_heads * self.value_head_dim
        return (hidden_size * (self.conv_channels + value_dim + 2 * self.value_heads)
                + self.conv_channels * self.conv_kernel + 2 * self.value_heads + self.value_head_dim
                + value_dim * hidden_size)

    def architecture(self) -> dict[str, Any]:
        return self.model_dump(exclude={"kernel"})


class Qwen35Config(LlamaConfig):
    type: Literal["qwen3_5"] = "qwen3_5"  # type: ignore[assignment]
    rope_theta: float = Field(10_000_000.0, gt=0.0)
    norm_eps: float = Field(1e-6, gt=0.0)
    partial_rotary_factor: float = Field(0.25, gt=0.0, le=1.0, description="Share of head_dim that RoPE rotates.")
    layer_types: list[MixerType] | None = Field(  # type: ignore[assignment]
        None, description="Per layer: linear_attention (Gated DeltaNet) or full_attention. None: every "
                          "full_attention_interval-th layer is full attention.")
    full_attention_interval: int = Field(4, ge=1)
    linear_attention: LinearAttentionSettings = Field(default_factory=LinearAttentionSettings)
    fused_linear_projections: bool = Field(
        False, description="Qwen3-Next's in_proj_qkvz / in_proj_ba (rows interleaved per key head) instead of "
                           "Qwen3.5's in_proj_qkv / z / b / a.")
    moe: MoESettings | None = Field(None, description="Experts in place of the dense MLP (qwen3_5_moe, qwen3_next).")
    shared_expert_size: int | None = Field(None, ge=1, description="The gated shared expert's width (MoE only).")
    dense_layers: list[int] = Field(default_factory=list, description="MoE layers that keep the dense MLP.")
    tie_embeddings: bool = False

    @model_validator(mode="after")
    def _check_hybrid(self) -> Qwen35Config:
        if self.sliding_window is not None or self.qkv_bias:
            raise ValueError("qwen3_5 has no sliding window and no q/k/v biases (sliding_window: null, qkv_bias: false)")
        rotary_width(self.head_dim, self.partial_rotary_factor)  # an odd or empty width raises
        if self.moe is None and (self.shared_expert_size is not None or self.dense_layers):
            raise ValueError("shared_expert_size and dense_layers need a moe section")
        check_dense_layers(self.dense_layers, self.num_layers)
        return self

    @property
    def rotary_dim(self) -> int:
        return rotary_width(self.head_dim, self.partial_rotary_factor)

    def is_linear(self, layer: int) -> bool:
        if self.layer_types is not None:
            return self.layer_types[layer] == "linear_attention"
        return (layer + 1) % self.full_attention_interval != 0

    def full_layers(self) -> int:
        """How many layers are full attention (counted without a loop over a hostile layer count)."""
        if self.layer_types is not None:
            return self.layer_types.count("full_attention")
        return self.num_layers // self.full_attention_interval

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.dense_layers

    # --- family interface --------------------------------------------------------------------------
    def layer_attention(self, layer: int) -> LayerAttention:
        if self.is_linear(layer):
            return LayerAttention(None, None)
        return LayerAttention(None, Rope(self.rope_theta, self.rope_scaling, self.rotary_dim))

    def build_block(self, layer: int) -> nn.Module:
        from fastlm.models.qwen3_5.blocks import qwen3_5_block

        return qwen3_5_block(self, layer)

    def build_final_norm(self) -> nn.Module:
        from fastlm.layers.norm import build_norm

        return build_norm("rmsnorm_offset", self.hidden_size, self.norm_eps)

    def device_issues(self, on_gpu: bool) -> list[ConfigIssue]:
        """kernel fla needs fla-core and a CUDA GPU (refused before any work, like model.head.use_triton)."""
        if self.linear_attention.kernel != "fla":
            return []
        if importlib.util.find_spec("fla") is None:
            return [ConfigIssue("model.linear_attention.kernel", "fla-core is not installed", "fla",
                                hint="pip install 'fastlm[fla]' (fla-core), or set kernel: auto (fla on CUDA when "
                                     "installed, PyTorch elsewhere)")]
        if not on_gpu:
            return [ConfigIssue("model.linear_attention.kernel", "fla-core's Triton kernels need a CUDA GPU, and "
                                "this run is on CPU", "fla", hint="set kernel: auto or torch")]
        return []

    def recurrent_state(self, layer: int) -> RecurrentShape | None:
        if not self.is_linear(layer):
            return None
        from fastlm.layers.kv_cache import RecurrentShape

        linear = self.linear_attention
        return RecurrentShape(linear.conv_channels, linear.conv_kernel, linear.value_heads, linear.key_head_dim,
                              linear.value_head_dim)

    # --- sizing ---------------------------------------------------------------------------------------
    def attention_parameters(self) -> int:
        """q (with its gate), k, v, o and the two per-head norms."""
        head_dim = self.head_dim or 0
        q_size, kv_size = self.num_heads * head_dim, self.kv_heads * head_dim
        return self.hidden_size * (2 * q_size + 2 * kv_size) + q_size * self.hidden_size + 2 * head_dim

    def _mlp_parameters(self, sparse: bool, active: bool) -> int:
        hidden = self.hidden_size
        if not sparse:
            return 3 * hidden * self.ffn_size
        assert self.moe is not None
        routed = (self.moe.active_layer_parameters if active else self.moe.layer_parameters)(hidden)
        return routed + shared_expert_parameters(hidden, self.shared_expert_size)

    def _mixer_parameters(self, linear: bool) -> int:
        return self.linear_attention.parameters(self.hidden_size) if linear else self.attention_parameters()

    def block_parameters(self, layer: int) -> int:
        return (2 * self.hidden_size + self._mixer_parameters(self.is_linear(layer))
                + self._mlp_parameters(self.is_sparse(layer), active=False))

    def _blocks(self, active: bool) -> int:
        full = self.full_layers()
        sparse = self.num_layers - len(self.dense_layers) if self.moe is not None else 0
        return (self.num_layers * 2 * self.hidden_size + full * self._mixer_parameters(False)
                + (self.num_layers - full) * self._mixer_parameters(True)
                + (sparse * self._mlp_parameters(True, active) if sparse else 0)
                + (self.num_layers - sparse) * self._mlp_parameters(False, active))

    def blocks_parameters(self) -> int:
        return self._blocks(active=False)

    def active_blocks_parameters(self) -> int:
        return self._blocks(active=True)

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Full layers: 12 * (q heads * head_dim) * seq_len, as `DecoderConfig`. Linear layers, per value
        head, forward: 6 K V for the state's read, correction and write, plus C (2 K + V) inside a chunk of
        C = 64 tokens (q.k and k.k scores, their products with the values); x3 with the backward."""
        linear = self.linear_attention
        per_head = 6 * linear.key_head_dim * linear.value_head_dim + DELTA_CHUNK * (
            2 * linear.key_head_dim + linear.value_head_dim)
        full = self.full_layers()
        return (full * 12.0 * self.num_heads * (self.head_dim or 0) * seq_len
                + (self.num_layers - full) * 3.0 * linear.value_heads * per_head)

    def architecture(self) -> dict[str, Any]:
        values = self.model_dump(mode="json", exclude=set(self.NOT_ARCHITECTURE) | {"linear_attention", "moe"})
        values.update(intermediate_size=self.ffn_size, num_kv_heads=self.kv_heads,
                      linear_attention=self.linear_attention.architecture(),
                      moe=None if self.moe is None else self.moe.architecture())
        pattern = self.layer_types is None or all(
            (kind == "linear_attention") == ((i + 1) % self.full_attention_interval != 0)
            for i, kind in enumerate(self.layer_types))
        if pattern:  # the same stack as the interval's: compare as the interval
            values["layer_types"] = None
        return values
