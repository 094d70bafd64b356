"""Gemma 4's MoE feed-forward (26B-A4B): a dense GeGLU MLP and routed experts side by side on the same residual
input, each between its own norms, summed. The experts' router reads the input RMS-normalised without a weight,
times a learned per-channel scale and hidden^-0.5; the experts read it through their own RMSNorm; the
renormalised top-k weights are multiplied by a learned per-expert scale (transformers' Gemma4TextRouter)."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from fastlm.layers.moe import ExpertBackend, MoEMLP, Routing, geglu_tanh, route


class ScaledRouterExperts(MoEMLP):
    """`MoEMLP` (GeGLU tanh experts, renormalised top-k) with Gemma 4's router input, expert input norm and
    per-expert scale (see the module docstring)."""

    def __init__(self, hidden_size: int, ffn_size: int, num_experts: int, top_k: int, eps: float,
                 backend: ExpertBackend = "auto", aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0) -> None:
        super().__init__(hidden_size, ffn_size, num_experts, top_k, normalize_top_k=True, backend=backend,
                         aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef, activation=geglu_tanh)
        self.router_norm = nn.RMSNorm(hidden_size, eps=eps, elementwise_affine=False)
        self.router_scale = nn.Parameter(torch.empty(hidden_size))
        self.per_expert_scale = nn.Parameter(torch.empty(num_experts))
        self.expert_norm = nn.RMSNorm(hidden_size, eps=eps)

    def route(self, flat: torch.Tensor, replay: torch.Tensor | None = None) -> Routing:
        scaled = self.router_norm(flat) * self.router_scale * self.hidden_size**-0.5
        routing = route(scaled, self.router.weight, self.top_k, normalize=True, replay=replay)
        return replace(routing, weights=routing.weights * self.per_expert_scale[routing.experts])

    def expert_input(self, flat: torch.Tensor) -> torch.Tensor:
        return self.expert_norm(flat)

    def reset_parameters(self, std: float, residual_std: float) -> None:
        super().reset_parameters(std, residual_std)
        nn.init.ones_(self.router_scale)
        nn.init.ones_(self.per_expert_scale)
        self.expert_norm.reset_parameters()


class DenseAndExperts(nn.Module):
    """x -> post_dense_norm(dense(dense_norm(x))) + post_experts_norm(experts(x)): the block's MLP slot with no
    norm before it (the block's post-MLP norm follows the sum)."""

    def __init__(self, dense_norm: nn.Module, dense: nn.Module, post_dense_norm: nn.Module,
                 experts: ScaledRouterExperts, post_experts_norm: nn.Module) -> None:
        super().__init__()
        self.dense_norm, self.dense, self.post_dense_norm = dense_norm, dense, post_dense_norm
        self.experts, self.post_experts_norm = experts, post_experts_norm

    def forward(self, x: torch.Tensor, real_tokens: torch.Tensor | None = None,
                experts: torch.Tensor | None = None) -> torch.Tensor:
        """The dense MLP's output plus the routed experts' (`experts`: routing replay's recorded choice)."""
        dense = self.post_dense_norm(self.dense(self.dense_norm(x)))
        return dense + self.post_experts_norm(self.experts(x, real_tokens, experts))

    def reset_parameters(self, std: float, residual_std: float) -> None:
        for norm in (self.dense_norm, self.post_dense_norm, self.post_experts_norm):
            norm.reset_parameters()
        self.dense.reset_parameters(std, residual_std)
        self.experts.reset_parameters(std, residual_std)
