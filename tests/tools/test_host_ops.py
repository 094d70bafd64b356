"""tools/profile/host_ops.py in a subprocess (it stubs the Triton launches of the process): the host work of
one call stays small where it used to make calls host-bound, a regression guard on op counts (not on
time). GSPO+z's call was 66 torch ops + 18 views around 3 launches (main 9398690), loss_type grpo's
weights 20 + 7 around 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_policy_calls_enqueue_few_torch_ops() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "profile" / "host_ops.py"), "--specs", "gspo+z", "grpo(seq)+z",
                           "--calls", "3"], cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    print(done.stdout)
    table = [[cell.strip() for cell in line.strip("|").split("|")] for line in done.stdout.splitlines()]
    rows = {cells[0]: cells for cells in table if len(cells) == 5 and cells[1] == "after"}
    ops = {spec: int(cells[2].split()[0]) for spec, cells in rows.items()}
    launches = {spec: int(cells[3].split(":")[0]) for spec, cells in rows.items()}
    assert ops["gspo+z"] <= 8 and launches["gspo+z"] == 4  # fused, seam, row sums, grad
    assert ops["grpo(seq)+z"] <= 6 and launches["grpo(seq)+z"] == 3  # weights, fused, row sums
