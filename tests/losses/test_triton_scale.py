"""The chunked head's grad_output scaling kernel (losses/triton/scale.py): the same values as `mul_` for
every scale (1 included, where the kernel skips the pass), dtype and size; the grid-stride loop past
MAX_PROGRAMS blocks. Without CUDA it runs on Triton's CPU interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from fastlm.losses.triton import scale as scale_module
from fastlm.losses.triton.scale import scale_unless_one

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("factor", [1.0, 0.75, -3.0, 0.0])
def test_scale_matches_mul(dtype: torch.dtype, factor: float) -> None:
    values = torch.randn(5000, generator=torch.Generator().manual_seed(7)).to(DEVICE, dtype)
    values[[3, 4999]] = torch.tensor([float("inf"), float("nan")], dtype=dtype, device=DEVICE)
    expected = values.clone().mul_(torch.tensor(factor, device=DEVICE))
    scale_unless_one(values, torch.tensor(factor, device=DEVICE))
    assert torch.equal(values.isnan(), expected.isnan())
    values, expected = values.nan_to_num(), expected.nan_to_num()
    if DEVICE.type == "cuda" or dtype == torch.float32:
        assert torch.equal(values, expected)
    else:  # Triton's CPU interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest even: one ulp apart
        assert ((values.float() - expected.float()).abs() <= expected.float().abs() * 2**-7).all()


def test_grid_stride_loop_and_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two programs walk 37 blocks of 16; a non-contiguous tensor and a float64 one take `mul_`."""
    monkeypatch.setattr(scale_module, "BLOCK", 16)
    monkeypatch.setattr(scale_module, "MAX_PROGRAMS", 2)
    values = torch.arange(590, dtype=torch.float32, device=DEVICE)
    scale_unless_one(values, torch.tensor([2.0], device=DEVICE))
    assert torch.equal(values, torch.arange(590, dtype=torch.float32, device=DEVICE) * 2)
    strided = torch.ones(8, 4, device=DEVICE).t()
    scale_unless_one(strided, torch.tensor(3.0, device=DEVICE))
    assert torch.equal(strided, torch.full((4, 8), 3.0, device=DEVICE))
    doubles = torch.ones(5, dtype=torch.float64, device=DEVICE)
    scale_unless_one(doubles, torch.tensor(0.5, dtype=torch.float64, device=DEVICE))
    assert torch.equal(doubles, torch.full((5,), 0.5, dtype=torch.float64, device=DEVICE))
