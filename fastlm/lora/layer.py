"""`LoraLinear`: an nn.Linear with frozen weight and bias (same names, so base checkpoints load unchanged) and
fp32 low-rank adapters on row slices of its output.

A fused projection (qkv, gate/up) gets one adapter per slice, so each slice is exactly PEFT's adapter on
the separate projection: y = x W^T + b, then y[rows of slice s] += scale * B_s (A_s dropout(x)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective), or the tensor itself."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


@dataclass(frozen=True)
class Slice:
    """Output rows [start, start + size) of a linear, named by its role (`q`, `gate`, `down`, ...)."""

    role: str
    start: int
    size: int


class LoraLinear(nn.Linear):
    """See the module docstring. `adapters_enabled = False` (see `fastlm.lora.attach.adapters_disabled`) gives
    the base linear; `merge()` folds the adapters into a new weight and `unmerge()` restores the original one."""

    def __init__(self, linear: nn.Linear, slices: list[Slice], rank: int, scale: float, dropout: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.slices = slices
        self.rank, self.scale = rank, scale
        device = linear.weight.device
        self.lora_A = nn.ParameterDict(
            {s.role: nn.Parameter(torch.zeros(rank, self.in_features, device=device)) for s in slices})
        self.lora_B = nn.ParameterDict({s.role: nn.Parameter(torch.zeros(s.size, rank, device=device)) for s in slices})
        self.lora_dropout = nn.Dropout(dropout)
        self.adapters_enabled = True
        self._unmerged: torch.Tensor | None = None  # the base weight while merged

    @torch.no_grad()
    def reset_adapters(self, init: str, generator: torch.Generator) -> None:
        """B = 0 (the model starts as the base); A Kaiming-uniform (PEFT's default) or N(0, 1/rank^2), drawn on
        the CPU from `generator` (the same values on any device and world size); nothing on the meta device."""
        for role, down in self.lora_A.items():
            if down.is_meta:
                continue
            values = torch.empty(down.shape)
            if init == "kaiming":
                nn.init.kaiming_uniform_(values, a=math.sqrt(5), generator=generator)
            else:
                nn.init.normal_(values, std=1.0 / self.rank, generator=generator)
            down.copy_(values)
            self.lora_B[role].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.adapters_enabled or self._unmerged is not None:
            return out
        h = self.lora_dropout(x)
        roles = [s.role for s in self.slices]
        down = F.linear(h, torch.cat([self.lora_A[r] for r in roles]) if len(roles) > 1 else self.lora_A[roles[0]])
        for index, s in enumerate(self.slices):  # the output's own rows: no (tokens, out) zeros for untargeted slices
            delta = F.linear(down[..., index * self.rank:(index + 1) * self.rank], self.lora_B[s.role]) * self.scale
            out.narrow(-1, s.start, s.size).add_(delta)
        return out

    def delta_weight(self) -> torch.Tensor:
        """scale * B A in the rows of each slice, (out, in) fp32: what merging adds to the weight (full
        tensors: FSDP-sharded adapters are gathered)."""
        delta = torch.zeros(self.out_features, self.in_features, device=self.weight.device)
        for s in self.slices:
            up, down = full_tensor(self.lora_B[s.role]).float(), full_tensor(self.lora_A[s.role]).float()
            delta[s.start:s.start + s.size] = (up @ down) * self.scale
        return delta

    @torch.no_grad()
    def merge(self) -> None:
        """Serve W + scale B A from one matmul; the original weight is kept so `unmerge` restores it bit for bit."""
        if self._unmerged is None:
            self._unmerged = self.weight.data
            self.weight.data = (self.weight.data.float() + self.delta_weight()).to(self.weight.dtype)

    @torch.no_grad()
    def unmerge(self) -> None:
        if self._unmerged is not None:
            self.weight.data, self._unmerged = self._unmerged, None

    def extra_repr(self) -> str:
        roles = ",".join(s.role for s in self.slices)
        return f"{super().extra_repr()}, lora rank={self.rank}, scale={self.scale:g}, slices={roles}"
