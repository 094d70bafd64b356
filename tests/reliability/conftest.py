"""One uninterrupted reference run shared by every kill and signal test (a subprocess start costs seconds)."""

from __future__ import annotations

import pytest
from crash_harness import STEPS, reference_losses


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """train/loss per step of the tiny run, STEPS steps, never interrupted."""
    return reference_losses(tmp_path_factory.mktemp("reference"), STEPS)
