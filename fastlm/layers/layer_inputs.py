"""Per-layer input embeddings (PLE, Gemma 4 E2B / E4B): besides the residual stream, every token brings each
layer a small signal of its own, read from a second embedding table and a projection of the token's main
embedding; each block mixes its slice into the residual after its MLP. Computed in the forward's dtype, in
transformers' order of operations (so fp32 imports give the same values)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastlm.layers.init import init_linear


class PerLayerInputs(nn.Module):
    """(B, S) ids and their (B, S, H) scaled main embedding -> (B, S, layers, width): (RMSNorm(projection(e) *
    H^-0.5) + tokens(ids) * sqrt(width)) * 2^-0.5, the norm per layer's slice."""

    def __init__(self, vocab_size: int, hidden_size: int, num_layers: int, width: int, eps: float) -> None:
        super().__init__()
        self.num_layers, self.width, self.hidden_size = num_layers, width, hidden_size
        self.tokens = nn.Embedding(vocab_size, num_layers * width)
        self.projection = nn.Linear(hidden_size, num_layers * width, bias=False)
        self.norm = nn.RMSNorm(width, eps=eps)

    def forward(self, input_ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        shape = (*input_ids.shape, self.num_layers, self.width)
        tokens = self.tokens(input_ids) * torch.tensor(self.width**0.5, dtype=self.tokens.weight.dtype)
        projected = self.norm((self.projection(embedded) * self.hidden_size**-0.5).reshape(shape))
        return (projected + tokens.reshape(shape)) * 2**-0.5

    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.tokens.weight, mean=0.0, std=std)
        init_linear(self.projection, std)
        self.norm.reset_parameters()


class LayerInputMixer(nn.Module):
    """One block's use of its per-layer input u (B, S, width): x -> RMSNorm(up(gelu_tanh(gate(x)) * u)), added to
    the residual by the block."""

    def __init__(self, hidden_size: int, width: int, eps: float) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, width, bias=False)
        self.projection = nn.Linear(width, hidden_size, bias=False)
        self.norm = nn.RMSNorm(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor, layer_input: torch.Tensor) -> torch.Tensor:
        return self.norm(self.projection(F.gelu(self.gate(x), approximate="tanh") * layer_input))

    def reset_parameters(self, std: float, residual_std: float) -> None:
        init_linear(self.gate, std)
        init_linear(self.projection, residual_std)
        self.norm.reset_parameters()
