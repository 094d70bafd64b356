"""The training benchmark's CPU mode runs end to end and prints its table (timings are not asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_train_cpu_smoke_prints_plain_and_packed_rows() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_train.py"), "--cpu-smoke"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    rows = [line.split("|") for line in result.stdout.splitlines() if line.startswith("| tiny-llama | compiled |")]
    assert [(row[3].strip(), row[4].strip()) for row in rows] == [("plain", "causal"), ("packed", "dense")], result.stdout
    assert all(float(row[8].replace(",", "")) > 0 for row in rows)
