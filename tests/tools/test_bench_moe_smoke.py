"""The MoE benchmark's CPU mode runs end to end: layer rows for fastlm's grouped, Triton (interpreted) and loop
paths and transformers' block, each one's error against the loop, and whole-model rows beside the dense twin
(timings not asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_moe_cpu_smoke() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_moe.py"), "--cpu-smoke", "--models", "mixtral-tiny"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    rows = [line.split("|") for line in result.stdout.splitlines() if line.startswith("| ")]
    layer = {row[2].strip(): row for row in rows if row[1].strip().startswith("E8 k2")}
    assert {"fastlm grouped", "fastlm triton", "fastlm loop", "transformers eager"} <= set(layer), result.stdout
    assert all(float(row[3]) > 0 for row in layer.values())
    for name in ("fastlm grouped", "fastlm triton", "transformers eager"):
        out_error, dx_error = (float(value) for value in layer[name][5].split("/"))
        assert out_error < 1e-5 and dx_error < 1e-5, name  # float32 on CPU: every path equals the loop
    models = {row[1].strip(): row for row in rows if row[1].strip().startswith("mixtral-tiny")}
    assert set(models) == {"mixtral-tiny dense twin", "mixtral-tiny grouped", "mixtral-tiny loop"}, result.stdout
    millions = {name: (float(row[2].strip(" M")), float(row[3].strip(" M"))) for name, row in models.items()}
    total, active = millions["mixtral-tiny grouped"]
    assert active < total and abs(millions["mixtral-tiny dense twin"][0] - active) <= 0.1  # twin: the active size
    assert all(float(row[4].replace(",", "")) > 0 for row in models.values())
