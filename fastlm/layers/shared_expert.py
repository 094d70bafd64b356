"""A routed feed-forward block beside always-on shared experts: routed(x) + shared(x), the shared branch
optionally behind a per-token sigmoid gate (Qwen2-MoE / Qwen3.5: sigmoid(gate(x)) * shared(x); DeepSeek-V3:
no gate). Called like every feed-forward block, `forward(x, real_tokens)`."""

from __future__ import annotations

import torch
from torch import nn

from fastlm.layers.init import init_linear


class SharedExpertMLP(nn.Module):
    """`routed` (an `MoEMLP`: its router losses and state-dict names stay under `routed.`), `shared` (a dense
    MLP, e.g. `GatedMLP` of width n_shared * expert width) and `gate` (Linear(H, 1) or None)."""

    def __init__(self, routed: nn.Module, shared: nn.Module, gate: nn.Linear | None) -> None:
        super().__init__()
        self.routed = routed
        self.shared = shared
        self.gate = gate

    def forward(self, x: torch.Tensor, real_tokens: torch.Tensor | None = None) -> torch.Tensor:
        shared = self.shared(x)
        if self.gate is not None:
            shared = torch.sigmoid(self.gate(x)) * shared
        return self.routed(x, real_tokens) + shared

    def reset_parameters(self, std: float, residual_std: float) -> None:
        self.routed.reset_parameters(std, residual_std)
        self.shared.reset_parameters(std, residual_std)
        if self.gate is not None:
            init_linear(self.gate, std)
