"""tools/bench_losses.py --cpu-smoke end to end in a subprocess: every (spec, shape) row in the
table, every implementation timed (the deferred-checks call too), the JSON written to $OUT, and the
tune table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "bench_losses.py"
SPECS = ("ce", "ce+z", "grpo+z", "ce+z+grpo", "gspo+z", "ce+kd",
         "grpo(seq)+z", "grpo(bnpo)+z", "grpo(dr)+z", "grpo(delta,H)+z", "grpo(beta)+z", "cispo+z",  # beside GRPO+z
         "ce+kd(both)")  # distillation temperature_mode both, beside ce+kd


def _run(tmp_path: Path, *flags: str) -> str:
    env = {**os.environ, "OUT": str(tmp_path), "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_cpu_smoke_table_has_every_row(tmp_path: Path) -> None:
    out = _run(tmp_path)
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| spec")]
    assert sorted(line.split(" | ")[0][2:] for line in rows) == sorted(SPECS)
    for line in rows:
        cells = line.split(" | ")
        assert cells[1:3] == ["8", "96"] and "(" in cells[4], line  # triton timed with its x R1
    report = json.loads((tmp_path / "bench_losses.json").read_text())
    for row in report["rows"]:
        expected = {"triton", "triton-deferred", "triton-inplace", "copy", "compiled", "eager"}
        expected |= {"triton-kernel"} if row["spec"] != "gspo+z" else set()
        assert set(row["ms"]) == expected and all(t > 0 for t in row["ms"].values()), row
        assert row["grad_rel_err_vs_compiled"] < 2e-2, row  # bf16 gradients, rounded independently
        assert row["r1_bytes"] >= 2 * 8 * 96 * 2


def test_cpu_smoke_tune_table(tmp_path: Path) -> None:
    """Both default specs x 2 blocks x 2 warps, the kernel alone timed at each point; one best point
    per spec and one suggested default."""
    out = _run(tmp_path, "--tune")
    rows = [line for line in out.splitlines() if line.startswith(("| ce+z+grpo ", "| ce "))]
    assert len(rows) == 8, out[-2000:]
    report = json.loads((tmp_path / "bench_losses.json").read_text())
    assert len(report["tune"]) == 8 and all(r["kernel_ms"] > 0 for r in report["tune"])
    assert sorted(r["spec"] for r in report["tune"] if r["best_kernel"]) == ["ce", "ce+z+grpo"]
    assert [line for line in out.splitlines() if line.startswith("suggested default V=96: max_block ")], out[-2000:]
    assert len(report["suggested"]) == 1 and report["suggested"][0]["score"] >= 1.0


@pytest.mark.slow
def test_cpu_smoke_before_after(tmp_path: Path) -> None:
    """--baseline: tools/bench/make_baseline.sh writes HEAD's package as fastlm_base, and the table times
    both trees on the same inputs (identical code here, so identical gradients)."""
    baseline = tmp_path / "baseline"
    subprocess.run(["bash", str(ROOT / "tools" / "bench" / "make_baseline.sh"), "HEAD", str(baseline)], cwd=ROOT,
                   check=True, capture_output=True, timeout=60)
    out = _run(tmp_path, "--baseline", str(baseline), "--specs", "grpo(seq)+z")
    assert [line for line in out.splitlines() if line.startswith("| grpo(seq)+z | 8 | 96 |")], out[-2000:]
    (row,) = json.loads((tmp_path / "bench_losses.json").read_text())["ab_rows"]
    assert set(row["before"]) == set(row["after"]) == {"deferred", "host", "kernel"} and row["grad_rel_diff"] == 0.0, row
