"""Weight initialisation shared by every projection: normal(0, std) weights, zero biases."""

from __future__ import annotations

from torch import nn


def init_linear(linear: nn.Linear, std: float) -> None:
    """In place; a no-op on meta tensors, so it also runs on a dry-run model."""
    nn.init.normal_(linear.weight, mean=0.0, std=std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)
