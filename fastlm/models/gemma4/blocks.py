"""Gemma 4 block composition: Gemma 3's sandwich (plain RMSNorms here) around attention with QK-norm, a
weightless value norm and scale 1 (per-layer head width and kv heads; global layers may take the keys as
values) and the GeGLU (tanh) MLP, then the per-layer input's mixer (E2B / E4B); the block's output times the
layer's fixed scalar (HF `layer_scalar`). KV-sharing layers have no key/value projections (the decoder wires
them to their source layer: `DecoderConfig.kv_source`). With `moe` (26B-A4B) the MLP slot holds the dense MLP
and the routed experts side by side, each between its norms (`DenseAndExperts`)."""

from __future__ import annotations

from typing import Protocol

import torch

from fastlm.layers.attention import Attention
from fastlm.layers.block import DecoderBlock
from fastlm.layers.dense_and_experts import DenseAndExperts, ScaledRouterExperts
from fastlm.layers.layer_inputs import LayerInputMixer
from fastlm.layers.mlp import GatedMLP
from fastlm.layers.norm import build_norm
from fastlm.models.moe_family import MoESettings


class Gemma4Shape(Protocol):
    """What the Gemma 4 block reads of `Gemma4Config` (the block never imports its config back)."""

    hidden_size: int
    num_heads: int
    norm_eps: float
    dropout: float
    values_from_keys: bool
    per_layer_input_width: int
    moe: MoESettings | None

    def layer_kv_shape(self, layer: int) -> tuple[int, int]: ...

    def is_sliding(self, layer: int) -> bool: ...

    def kv_source(self, layer: int) -> int: ...

    def layer_ffn_size(self, layer: int) -> int: ...


class ScaledBlock(DecoderBlock):
    """A `DecoderBlock` whose output (residual stream included) is multiplied by `layer_scalar`, a stored
    constant (a buffer: the checkpoint's value, not trained), 1 at init."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.register_buffer("layer_scalar", torch.ones(1))

    def _forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        return super()._forward(*args, **kwargs) * self.layer_scalar  # type: ignore[arg-type]

    def reset_parameters(self, std: float, residual_std: float) -> None:
        super().reset_parameters(std, residual_std)
        torch.nn.init.ones_(self.layer_scalar)


def gemma4_block(config: Gemma4Shape, layer: int) -> ScaledBlock:
    def norm() -> torch.nn.Module:
        return build_norm("rmsnorm", config.hidden_size, config.norm_eps)

    kv_heads, width = config.layer_kv_shape(layer)
    attention = Attention(config.hidden_size, config.num_heads, kv_heads, qkv_bias=False, out_bias=False,
                          dropout=config.dropout, head_dim=width, qk_norm="rmsnorm", norm_eps=config.norm_eps,
                          scale=1.0, values_from_keys=config.values_from_keys and not config.is_sliding(layer),
                          value_norm=True, shared_kv=config.kv_source(layer) != layer)
    mixer = LayerInputMixer(config.hidden_size, config.per_layer_input_width, config.norm_eps) \
        if config.per_layer_input_width else None
    mlp = GatedMLP(config.hidden_size, config.layer_ffn_size(layer), "gelu_tanh")
    if config.moe is None:
        return ScaledBlock(norm(), attention, norm(), mlp, config.dropout, post_attn_norm=norm(),
                           post_mlp_norm=norm(), layer_input_mixer=mixer)
    moe = config.moe
    experts = ScaledRouterExperts(config.hidden_size, moe.ffn_size, moe.num_experts, moe.top_k, config.norm_eps,
                                  moe.backend, moe.aux_loss_coef, moe.z_loss_coef)
    return ScaledBlock(norm(), attention, None, DenseAndExperts(norm(), mlp, norm(), experts, norm()), config.dropout,
                       post_attn_norm=norm(), post_mlp_norm=norm(), layer_input_mixer=mixer)
