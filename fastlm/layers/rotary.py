"""Rotary position embeddings (RoPE), half-split convention (as in the Hugging Face Llama code).

Frequencies are recomputed from the positions on every call instead of a cached buffer: the cost is
tiny (S x head_dim/2), it works with per-document positions, and there is no buffer to re-create
after building on the meta device.
"""

from __future__ import annotations

import torch


def rotary_angles(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * theta^(-2i/head_dim), fp32, shape positions.shape + (head_dim/2,)."""
    if head_dim % 2:
        raise ValueError(f"rotary head_dim must be even, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    inv_freq = theta ** (-exponents)
    angles = positions.to(torch.float32)[..., None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, heads, S, D) by per-position angles cos/sin (B or 1, S, D/2).

    The math runs in at least fp32 (bf16 activations are upcast), in float64 for float64 inputs.
    """
    half = x.shape[-1] // 2
    compute = torch.promote_types(x.dtype, torch.float32)
    x1, x2 = x[..., :half].to(compute), x[..., half:].to(compute)
    cos, sin = cos[:, None].to(compute), sin[:, None].to(compute)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)
