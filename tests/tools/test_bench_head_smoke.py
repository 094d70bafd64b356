"""tools/bench_head.py --cpu-smoke end to end in a subprocess: a row per spec, the floor and every fastlm
column timed, their gradients within bf16 rounding of the float32 reference, the JSON written to $OUT."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPECS = ("ce", "ce+z+grpo", "ce+kd", "gspo+z")


def test_cpu_smoke_times_every_fastlm_column(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path)}
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_head.py"), "--cpu-smoke", "--specs", *SPECS],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and not line.startswith("| spec")]
    assert sorted(line.split(" | ")[0][2:] for line in rows) == sorted(SPECS), done.stdout[-2000:]
    report = json.loads((tmp_path / "bench_head.json").read_text())
    for row in report["rows"]:
        assert not row["failed"], row
        assert {"floor", "chunked", "chunked+fp32dW", "full", "eager"} <= set(row["ms"]), row
        assert all(ms > 0 for ms in row["ms"].values()) and row["x_floor"]["floor"] == 1.0
        assert set(row["err"]) == {"chunked", "chunked+fp32dW", "full"}
        assert all(value < 2e-2 for errors in row["err"].values() for value in errors.values()), row["err"]
