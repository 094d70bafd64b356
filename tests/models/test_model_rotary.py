"""RoPE: relative-position property, norm preservation, and a float64 complex-number reference."""

from __future__ import annotations

import pytest
import torch
from model_helpers import relative_error

from fastlm.layers.rotary import apply_rotary, rotary_angles

HEAD_DIM = 16


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """x (1, heads, S, D) at positions (1, S)."""
    return apply_rotary(x, *rotary_angles(positions, HEAD_DIM, theta))


def test_dot_products_depend_only_on_distance() -> None:
    torch.manual_seed(0)
    q = torch.randn(1, 2, 1, HEAD_DIM, dtype=torch.float64)
    k = torch.randn(1, 2, 1, HEAD_DIM, dtype=torch.float64)
    worst = 0.0
    for m, n in [(0, 0), (3, 1), (7, 2), (2, 9)]:
        base = (rotate(q, torch.tensor([[m]])) * rotate(k, torch.tensor([[n]]))).sum(-1)
        for shift in (1, 5, 100):
            moved = (rotate(q, torch.tensor([[m + shift]])) * rotate(k, torch.tensor([[n + shift]]))).sum(-1)
            worst = max(worst, relative_error(moved, base))
    print(f"RoPE relative-position property: worst rel err {worst:.2e}")
    assert worst < 1e-5  # the angles are fp32 (as in training), so not float64-exact
    at_zero = (q * k).sum(-1)
    same_position = (rotate(q, torch.tensor([[11]])) * rotate(k, torch.tensor([[11]]))).sum(-1)
    assert relative_error(same_position, at_zero) < 1e-5


def test_rotation_preserves_norm_and_changes_vectors() -> None:
    torch.manual_seed(1)
    x = torch.randn(1, 3, 6, HEAD_DIM, dtype=torch.float64)
    rotated = rotate(x, torch.arange(6)[None])
    assert relative_error(rotated.norm(dim=-1), x.norm(dim=-1)) < 1e-6
    assert torch.equal(rotated[:, :, 0], x[:, :, 0])  # position 0 is the identity
    assert (rotated[:, :, 1:] - x[:, :, 1:]).abs().max() > 1e-2


@pytest.mark.parametrize("theta", [10000.0, 1e6])
def test_matches_complex_reference(theta: float) -> None:
    """Pair (x_i, x_{i+D/2}) is the complex number x_i + i*x_{i+D/2}, multiplied by e^{i*pos*freq_i}."""
    torch.manual_seed(2)
    x = torch.randn(2, 2, 5, HEAD_DIM, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 0, 1, 2]])
    freq = theta ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    phase = torch.polar(torch.ones(2, 5, HEAD_DIM // 2, dtype=torch.float64), positions[..., None] * freq)
    half = HEAD_DIM // 2
    z = torch.complex(x[..., :half], x[..., half:]) * phase[:, None]
    expected = torch.cat([z.real, z.imag], dim=-1)
    error = relative_error(apply_rotary(x, *rotary_angles(positions, HEAD_DIM, theta)), expected)
    print(f"RoPE vs complex reference (theta={theta:g}): rel err {error:.2e}")
    assert error < 1e-6


def test_odd_head_dim_is_rejected() -> None:
    with pytest.raises(ValueError, match="even"):
        rotary_angles(torch.arange(4)[None], 7, 10000.0)


def test_partial_rotary_turns_only_the_first_dims() -> None:
    """cos/sin for R < D dims (GLM-4): the first R dims rotate exactly as a head of R dims would, the rest
    pass unchanged (float64)."""
    x = torch.randn(2, 3, 5, 12, dtype=torch.float64)
    cos, sin = rotary_angles(torch.arange(5)[None], 4, 10000.0)
    out = apply_rotary(x, cos, sin)
    assert torch.equal(out[..., 4:], x[..., 4:])
    assert torch.equal(out[..., :4], apply_rotary(x[..., :4].contiguous(), cos, sin))
    assert not torch.equal(out[..., :4], x[..., :4])
