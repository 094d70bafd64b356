"""Count the places where a training step reads a tensor's value back to the host.

On a GPU each such read (`float(t)`, `int(t)`, `bool(t)`, `.item()`, `.tolist()`, `.cpu()`, `.numpy()`)
makes the host wait for everything queued. On CPU nothing waits, so the CPU tests find them by patching
those methods and recording the innermost fastlm frame of each call. Reads of host-side data (the
batch before it is copied to the device, in fastlm/data) and the CPU-only id check of the model are
not device reads and are kept apart.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import fastlm

PACKAGE = Path(fastlm.__file__).resolve().parent
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


def _host_side(path: str, function: str) -> bool:
    """Batches are built and counted on the host before their copy to the device (fastlm/data), and the
    model checks the id range of CPU tensors only."""
    return path.startswith("data/") or (path, function) == ("models/decoder.py", "_check_inputs")


def _site() -> tuple[str, str, int] | None:
    """(path under fastlm/, function, line) of the innermost fastlm frame calling a read, or None."""
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        if path.is_relative_to(PACKAGE):
            return str(path.relative_to(PACKAGE)), frame.f_code.co_name, frame.f_lineno
        frame = frame.f_back
    return None


class HostReads:
    """The device-side reads seen, as 'path:function:line' -> count (host-side data reads left out)."""

    def __init__(self) -> None:
        self.sites: Counter[str] = Counter()

    def record(self) -> None:
        site = _site()
        if site is None:
            return
        path, function, line = site
        if _host_side(path, function):
            return
        self.sites[f"{path}:{function}:{line}"] += 1

    def at(self, path: str, function: str) -> int:
        return sum(count for site, count in self.sites.items() if site.startswith(f"{path}:{function}:"))

    def __str__(self) -> str:
        return ", ".join(f"{site} x{count}" for site, count in sorted(self.sites.items())) or "none"


@contextmanager
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[HostReads]:
    reads = HostReads()
    with monkeypatch.context() as patch:
        for name in READS:
            original = getattr(torch.Tensor, name)

            def counted(self: torch.Tensor, *args, _original=original, **kwargs):  # noqa: ANN001, ANN202
                reads.record()
                return _original(self, *args, **kwargs)

            patch.setattr(torch.Tensor, name, counted)
        yield reads
