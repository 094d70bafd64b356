"""Gemma 4 family config (text): Gemma 3's sliding and global layers, sandwich norms, QK-norm and GeGLU, with
plain (w, not 1 + w) RMSNorms, an unscaled attention (scale 1: the QK-norms set the temperature), values
RMS-normalised without a weight, global layers with their own head width and kv heads (and, with
`values_from_keys`, no value projection: HF attention_k_eq_v) under proportional RoPE (the first
`partial_rotary_factor` of the frequencies of the whole head turn), a fixed scalar on each layer's output, and
the final logits softcapped. E2B / E4B's options: per-layer input embeddings (`per_layer_input_width`:
fastlm/layers/layer_inputs.py), the last `kv_shared_layers` attending over the keys and values of the last
earlier layer of their kind (no k/v projections of their own; in generation that layer's cache), and those
layers' MLPs twice as wide (`double_wide_mlp`). 26B-A4B's MoE block (`moe`): routed experts beside the dense
MLP in every layer (fastlm/layers/dense_and_experts.py)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, model_validator

from fastlm.models.base import LayerAttention, Rope
from fastlm.models.llama.config import LlamaConfig
from fastlm.models.moe_family import MoESettings

if TYPE_CHECKING:
    from torch import nn

GLOBAL_EVERY = 6  # without layer_types, every 6th layer is global (and the last one: transformers forces it)


class Gemma4Config(LlamaConfig):
    type: Literal["gemma4"] = "gemma4"  # type: ignore[assignment]
    rope_theta: float = Field(1_000_000.0, gt=0.0, description="RoPE base of the global layers.")
    rope_local_theta: float = Field(10_000.0, gt=0.0, description="RoPE base of the sliding-window layers.")
    partial_rotary_factor: float = Field(
        0.25, gt=0.0, le=1.0, description="Global layers: the share of the head's frequencies that turn (proportional "
                                          "RoPE; 1.0: plain RoPE over the whole head).")
    global_head_dim: int | None = Field(None, ge=2, description="Head width of the global layers; default head_dim.")
    num_global_kv_heads: int | None = Field(None, ge=1, description="kv heads of the global layers; default num_kv_heads.")
    values_from_keys: bool = Field(False, description="Global layers: values = the key projection (HF attention_k_eq_v).")
    final_logit_softcap: float | None = Field(None, gt=0.0, description="The head's softcap (HF final_logit_softcapping).")
    per_layer_input_width: int = Field(0, ge=0, description="Per-layer input embeddings' width per layer (HF "
                                                            "hidden_size_per_layer_input); 0: none.")
    per_layer_vocab_size: int | None = Field(None, ge=1, description="Their vocabulary; default vocab_size.")
    kv_shared_layers: int = Field(0, ge=0, description="The last layers that reuse an earlier layer's keys and values "
                                                       "(HF num_kv_shared_layers).")
    double_wide_mlp: bool = Field(False, description="The KV-sharing layers' MLPs are twice intermediate_size.")
    moe: MoESettings | None = Field(None, description="Routed GeGLU experts beside the dense MLP in every layer "
                                                      "(HF enable_moe_block); None: dense only.")
    norm_eps: float = Field(1e-6, gt=0.0)
    tie_embeddings: bool = True

    global_every: ClassVar[int | None] = GLOBAL_EVERY

    @model_validator(mode="after")
    def _check_global_layers(self) -> Gemma4Config:
        if self.num_heads % self.global_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_global_kv_heads {self.global_kv_heads}")
        if self.global_width % 2:
            raise ValueError(f"global_head_dim {self.global_width} must be even for rotary embeddings")
        if self.kv_shared_layers >= self.num_layers:
            raise ValueError(f"kv_shared_layers {self.kv_shared_layers} must leave a layer that computes keys and "
                             f"values (num_layers {self.num_layers})")
        if self.kv_shared_layers:
            first = self.num_layers - self.kv_shared_layers
            own = {self.is_sliding(layer) for layer in range(first)}
            if any(self.is_sliding(layer) not in own for layer in range(first, self.num_layers)):
                raise ValueError("a KV-sharing layer has no earlier layer of its kind (sliding / full) to share with")
        if self.per_layer_input_width and (self.per_layer_vocab_size or self.vocab_size) < self.vocab_size:
            raise ValueError(f"per_layer_vocab_size {self.per_layer_vocab_size} must cover vocab_size {self.vocab_size}")
        return self

    @property
    def global_width(self) -> int:
        return self.global_head_dim or self.head_dim or 0

    @property
    def global_kv_heads(self) -> int:
        return self.num_global_kv_heads or self.kv_heads

    @property
    def turning_frequencies(self) -> int | None:
        """How many of the global head's width / 2 frequencies turn (transformers' int(factor * width // 2));
        None: all of them."""
        turning = int(self.partial_rotary_factor * self.global_width // 2)
        return None if turning == self.global_width // 2 else turning

    def kv_source(self, layer: int) -> int:
        """transformers' rule: a layer of the last kv_shared_layers reads the last earlier layer of its kind."""
        first = self.num_layers - self.kv_shared_layers
        if layer < first:
            return layer
        return max(earlier for earlier in range(first) if self.is_sliding(earlier) == self.is_sliding(layer))

    def layer_ffn_size(self, layer: int) -> int:
        return self.ffn_size * (2 if self.double_wide_mlp and self.kv_source(layer) != layer else 1)

    def build_layer_inputs(self) -> nn.Module | None:
        if not self.per_layer_input_width:
            return None
        from fastlm.layers.layer_inputs import PerLayerInputs

        return PerLayerInputs(self.per_layer_vocab_size or self.vocab_size, self.hidden_size, self.num_layers,
                              self.per_layer_input_width, self.norm_eps)

    def layer_kv_shape(self, layer: int) -> tuple[int, int]:
        if self.is_sliding(layer):
            return self.kv_heads, self.head_dim or 0
        return self.global_kv_heads, self.global_width

    def layer_attention(self, layer: int) -> LayerAttention:
        if self.is_sliding(layer):
            return LayerAttention(self.sliding_window, Rope(self.rope_local_theta))
        return LayerAttention(None, Rope(self.rope_theta, dims=self.global_width, turning=self.turning_frequencies))

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size or 4 * self.hidden_size

    @property
    def embedding_scale(self) -> float:
        return math.sqrt(self.hidden_size)

    def head_transform(self) -> tuple[float, float | None]:
        return 1.0, self.final_logit_softcap

    def build_block(self, layer: int) -> nn.Module:
        from fastlm.models.gemma4.blocks import gemma4_block

        return gemma4_block(self, layer)

    def build_final_norm(self) -> nn.Module:
        from fastlm.layers.norm import build_norm

        return build_norm("rmsnorm", self.hidden_size, self.norm_eps)

    def block_parameters(self, layer: int) -> int:
        """Four sandwich norms, q_norm and k_norm (the value norm has no weight), q/k(/v)/o (q/o alone in a
        KV-sharing layer), the GeGLU MLP, the per-layer input's gate, projection and norm."""
        kv_heads, width = self.layer_kv_shape(layer)
        values = 0 if self.values_from_keys and not self.is_sliding(layer) else kv_heads * width
        own_kv = self.kv_source(layer) == layer
        keys_values = self.hidden_size * (kv_heads * width + values) + width if own_kv else 0  # with k_norm
        attention = self.hidden_size * 2 * self.num_heads * width + width + keys_values  # q, o, q_norm
        layer_input = (2 * self.per_layer_input_width + 1) * self.hidden_size if self.per_layer_input_width else 0
        return 4 * self.hidden_size + attention + 3 * self.hidden_size * self.layer_ffn_size(layer) + layer_input + \
            self._experts_parameters(active=False)

    def _experts_parameters(self, active: bool) -> int:
        """A layer's router (weight, channel and expert scales), its experts (all, or the top_k one token uses)
        and the three extra norms (pre-experts, after the dense MLP, after the experts)."""
        if self.moe is None:
            return 0
        moe, hidden = self.moe, self.hidden_size
        experts = moe.top_k if active else moe.num_experts
        return moe.num_experts * (hidden + 1) + hidden + experts * 3 * hidden * moe.ffn_size + 3 * hidden

    def active_blocks_parameters(self) -> int:
        inactive = self._experts_parameters(active=False) - self._experts_parameters(active=True)
        return self.blocks_parameters() - self.num_layers * inactive

    def embedding_parameters(self) -> int:
        """Tokens (+ untied head), and the per-layer inputs' table, projection and norm."""
        width = self.per_layer_input_width * self.num_layers
        per_layer = (self.per_layer_vocab_size or self.vocab_size) * width + self.hidden_size * width + \
            self.per_layer_input_width if width else 0
        return super().embedding_parameters() + per_layer

    def blocks_parameters(self) -> int:
        """Sliding and global layers differ in size (the adapter refuses an implausible layer count)."""
        return sum(self.block_parameters(layer) for layer in range(self.num_layers))

    def attention_flops_per_token(self, seq_len: int) -> float:
        """As the base, with each layer's own head width."""
        total = 0.0
        for layer in range(self.num_layers):
            window = self.layer_attention(layer).window
            total += 12.0 * self.num_heads * self.layer_kv_shape(layer)[1] * (min(seq_len, window) if window else seq_len)
        return total

    def architecture(self) -> dict[str, Any]:
        values = super().architecture()
        values["layer_types"] = ["sliding_attention" if self.is_sliding(layer) else "full_attention"
                                 for layer in range(self.num_layers)]
        values["global_head_dim"] = self.global_width
        values["num_global_kv_heads"] = self.global_kv_heads
        values["moe"] = None if self.moe is None else self.moe.architecture()
        values["per_layer_vocab_size"] = (self.per_layer_vocab_size or self.vocab_size) if self.per_layer_input_width \
            else None
        return values
