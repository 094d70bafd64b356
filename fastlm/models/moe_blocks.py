"""The sparse block the MoE families compose: their attention, pre-RMSNorms and an `MoEMLP` (router,
experts, the router-loss weights that `fastlm.layers.moe.add_router_losses` reads)."""

from __future__ import annotations

from torch import nn

from fastlm.layers.block import DecoderBlock
from fastlm.layers.moe import MoEMLP
from fastlm.layers.norm import build_norm
from fastlm.models.moe_family import MoESettings


def moe_mlp(hidden_size: int, settings: MoESettings) -> MoEMLP:
    return MoEMLP(hidden_size, settings.ffn_size, settings.num_experts, settings.top_k, settings.normalize_top_k,
                  backend=settings.backend, aux_loss_coef=settings.aux_loss_coef, z_loss_coef=settings.z_loss_coef)


def pre_norm_block(hidden_size: int, norm_eps: float, attention: nn.Module, mlp: nn.Module, dropout: float) -> DecoderBlock:
    """x + attn(rmsnorm(x)), then x + mlp(rmsnorm(x))."""
    return DecoderBlock(build_norm("rmsnorm", hidden_size, norm_eps), attention,
                        build_norm("rmsnorm", hidden_size, norm_eps), mlp, dropout)
