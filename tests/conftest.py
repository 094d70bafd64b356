"""Test-wide settings: wandb never reaches the network, Triton runs on its CPU interpreter without a GPU; under
pytest-xdist (addopts' `-n 2`) each worker runs torch on one thread, and the slow tests start first."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_DISABLE_GIT", "true")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One thread a worker (inherited by the `python -m fastlm` and torchrun subprocesses): two workers on two
    # cores, not four threads fighting for them.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
except ImportError:  # pragma: no cover - torch is a hard dependency
    pass


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The `slow` tests first (stable order otherwise), so a long test never starts as the last one on a worker
    while the other worker idles: the suite's wall time is about its total over the workers."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
