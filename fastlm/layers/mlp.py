"""Feed-forward blocks: GELU (GPT-2, with biases) and the gated MLPs SwiGLU (Llama) and GeGLU (Gemma).

Every feed-forward block (these and the MoE MLP, fastlm/layers/moe.py) is called as `mlp(x, real_tokens)`:
`real_tokens` (B, S), 1 real and 0 padding, is what a router's statistics count; a dense MLP ignores it."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from fastlm.layers.init import init_linear

GateActivation = Literal["silu", "gelu_tanh"]


class GeluMLP(nn.Module):
    """down(gelu_tanh(up(x))); the tanh GELU is what GPT-2 checkpoints were trained with."""

    def __init__(self, hidden_size: int, ffn_size: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, ffn_size, bias=True)
        self.down_proj = nn.Linear(ffn_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor, real_tokens: torch.Tensor | None = None) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))

    def reset_parameters(self, std: float, residual_std: float) -> None:
        init_linear(self.up_proj, std)
        init_linear(self.down_proj, residual_std)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), no biases; gate and up share one matmul (gate rows first, then up).
    act = silu: SwiGLU (Llama, Qwen, Phi-3); act = gelu_tanh: GeGLU (Gemma)."""

    def __init__(self, hidden_size: int, ffn_size: int, activation: GateActivation = "silu") -> None:
        super().__init__()
        self.activation = activation
        self.gate_up_proj = nn.Linear(hidden_size, 2 * ffn_size, bias=False)
        self.down_proj = nn.Linear(ffn_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, real_tokens: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        gate = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self.down_proj(gate * up)

    def reset_parameters(self, std: float, residual_std: float) -> None:
        init_linear(self.gate_up_proj, std)
        init_linear(self.down_proj, residual_std)
