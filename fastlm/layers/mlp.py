"""Feed-forward blocks: GELU (GPT-2, with biases) and SwiGLU (Llama, no biases)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastlm.layers.init import init_linear


class GeluMLP(nn.Module):
    """down(gelu_tanh(up(x))); the tanh GELU is what GPT-2 checkpoints were trained with."""

    def __init__(self, hidden_size: int, ffn_size: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, ffn_size, bias=True)
        self.down_proj = nn.Linear(ffn_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))

    def reset_parameters(self, std: float, residual_std: float) -> None:
        init_linear(self.up_proj, std)
        init_linear(self.down_proj, residual_std)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up share one matmul (gate first, then up)."""

    def __init__(self, hidden_size: int, ffn_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * ffn_size, bias=False)
        self.down_proj = nn.Linear(ffn_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def reset_parameters(self, std: float, residual_std: float) -> None:
        init_linear(self.gate_up_proj, std)
        init_linear(self.down_proj, residual_std)
