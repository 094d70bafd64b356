"""Normalisation layers: LayerNorm with bias (GPT-2), RMSNorm (Llama) and the offset RMSNorm of Gemma,
whose stored weight w scales by (1 + w) (initialised to 0)."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

NormKind = Literal["layernorm", "rmsnorm", "rmsnorm_offset"]


class OffsetRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), computed in fp32 and cast back (Gemma's order: the product before the cast)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size))
        self.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute = torch.promote_types(x.dtype, torch.float32)
        normed = F.rms_norm(x.to(compute), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.to(compute))).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


def build_norm(kind: NormKind, hidden_size: int, eps: float) -> nn.Module:
    """Every kind has `reset_parameters()` (the identity: weight 1 or offset 0, bias 0), which the decoder's init calls."""
    if kind == "layernorm":
        return nn.LayerNorm(hidden_size, eps=eps, bias=True)
    if kind == "rmsnorm":
        return nn.RMSNorm(hidden_size, eps=eps)
    if kind == "rmsnorm_offset":
        return OffsetRMSNorm(hidden_size, eps)
    raise ValueError(f"unknown norm kind {kind!r}; expected 'layernorm', 'rmsnorm' or 'rmsnorm_offset'")
