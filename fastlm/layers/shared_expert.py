"""A mixture of experts plus a shared expert every token goes through (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE:
behind a per-token sigmoid gate; DeepSeek-V3: ungated). Composes any routed feed-forward block (an `MoEMLP`)
with any dense one (a `GatedMLP`), so the MoE layer itself stays the routed part alone."""

from __future__ import annotations

import torch
from torch import nn

from fastlm.layers.init import init_linear


class SharedExpertMLP(nn.Module):
    """routed(x) + shared(x), the shared part times sigmoid(gate(x)) when a `gate` (H -> 1) is given.
    Called as every feed-forward block, `mlp(x, real_tokens)`; `real_tokens` reaches the routed part
    (its router statistics leave padding out)."""

    def __init__(self, routed: nn.Module, shared: nn.Module, gate: nn.Linear | None = None) -> None:
        super().__init__()
        self.routed = routed
        self.shared = shared
        self.gate = gate

    def forward(self, x: torch.Tensor, real_tokens: torch.Tensor | None = None,
                experts: torch.Tensor | None = None) -> torch.Tensor:
        """`experts` (routing replay) reaches the routed part, as `MoEMLP.forward` takes it."""
        shared = self.shared(x, real_tokens)
        if self.gate is not None:
            shared = torch.sigmoid(self.gate(x)) * shared
        return self.routed(x, real_tokens, experts) + shared

    def reset_parameters(self, std: float, residual_std: float) -> None:
        self.routed.reset_parameters(std, residual_std)
        self.shared.reset_parameters(std, residual_std)
        if self.gate is not None:
            init_linear(self.gate, std)
