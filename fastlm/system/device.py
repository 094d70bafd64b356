"""Device-side context shared by training, evaluation and sampling."""

from __future__ import annotations

import contextlib

import torch


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Autocast to `dtype` on `device`'s type; None runs in the tensors' own dtype."""
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
