"""The GPU's SM clock, power draw and temperature sampled in the background while benchmarks run.

A throughput that falls from one timing window to the next is either more work or a slower GPU (power or
thermal limits lower the SM clock under sustained load). `ClockSampler` runs `nvidia-smi --loop-ms` beside the
benchmark and averages its samples over any span of host time, so each timed row can carry the clock it ran
at. Without nvidia-smi or CUDA it samples nothing and every mean is None.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass

import torch

FIELDS = "index,clocks.sm,power.draw,temperature.gpu"


@dataclass
class ClockMean:
    sm_mhz: float
    power_w: float
    temperature_c: float
    samples: int


def parse_sample(line: str, gpu: int) -> tuple[float, float, float] | None:
    """(SM MHz, W, degrees C) of one `nvidia-smi --format=csv,noheader,nounits` line of GPU `gpu`, else None."""
    parts = [part.strip() for part in line.split(",")]
    if len(parts) != 4 or parts[0] != str(gpu):
        return None
    try:
        return float(parts[1]), float(parts[2]), float(parts[3])
    except ValueError:  # "[N/A]" and the like
        return None


def _physical_index() -> int:
    """nvidia-smi numbers GPUs physically; CUDA_VISIBLE_DEVICES may renumber them for torch."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    ordinal = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return int(visible) if visible.isdigit() else ordinal


class ClockSampler:
    """Context manager: samples every `period_ms` until closed; `mean(start, end)` over `time.monotonic()` stamps."""

    def __init__(self, period_ms: int = 200) -> None:
        self.samples: list[tuple[float, float, float, float]] = []  # (monotonic, MHz, W, C)
        self.process: subprocess.Popen[str] | None = None
        self.gpu = _physical_index()
        tool = shutil.which("nvidia-smi")
        if tool is None or not torch.cuda.is_available():
            return
        try:
            self.process = subprocess.Popen(
                [tool, f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits", f"--loop-ms={period_ms}"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )
        except OSError as error:  # the benchmark goes on without clock columns
            print(f"gpu_clocks: nvidia-smi did not start ({error}); no clock samples", flush=True)
            return
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            sample = parse_sample(line, self.gpu)
            if sample is not None:
                self.samples.append((time.monotonic(), *sample))

    def mean(self, start: float, end: float) -> ClockMean | None:
        """The mean of the samples taken between the `time.monotonic()` stamps, or None if there are none."""
        inside = [sample[1:] for sample in list(self.samples) if start <= sample[0] <= end]
        if not inside:
            return None
        count = len(inside)
        return ClockMean(*(sum(values) / count for values in zip(*inside)), samples=count)

    def close(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=5)
            self.process = None

    def __enter__(self) -> ClockSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
