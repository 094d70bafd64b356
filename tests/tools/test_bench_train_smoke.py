"""The training benchmark's CPU mode runs end to end and prints its table (timings are not asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_train_cpu_smoke_prints_a_row() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_train.py"), "--cpu-smoke"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    rows = [line for line in result.stdout.splitlines() if line.startswith("| tiny-llama | compiled |")]
    assert len(rows) == 1, result.stdout
    tokens_per_second = float(rows[0].split("|")[7].replace(",", ""))
    assert tokens_per_second > 0
