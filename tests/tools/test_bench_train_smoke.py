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


def test_bench_train_compare_cli_runs_the_trainer_beside_the_loop() -> None:
    """`--compare-cli` at the tiny CPU shape: the Trainer's logged windows (6 steps, one every 2, the first
    left out) beside the loop's packed row, and their ratio."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_train.py"), "--compare-cli", "--cpu-smoke"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    rows = [line.split("|") for line in result.stdout.splitlines() if line.startswith("| tiny-llama | 2x32 |")]
    assert len(rows) == 2, result.stdout  # as it is measured, and in the final table
    bench, cli, windows, ratio = (rows[-1][3], rows[-1][5].split("(")[0], rows[-1][5].split("(")[1], rows[-1][7])
    assert float(bench.replace(",", "")) > 0 and float(cli.replace(",", "")) > 0
    assert len(windows.split("/")) == 2, result.stdout
    assert float(ratio.strip(" *")) > 0
