"""tools/profile/kernel_report.py compiles the launcher's own fused launch for sm_90 on this GPU-less machine and
reads the registers and SASS back with Triton's bundled cuobjdump."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_report_row_for_a_looped_prefetching_kernel(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "profile" / "kernel_report.py"), "--spec", "ce+kd", "--vocab", "32000",
         "--prefetch", "1", "--sass-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ce+kd |")]
    assert len(rows) == 1, done.stdout
    spec, vocab, block, warps, prefetch, registers, stack, local, instructions = rows[0].strip("| ").split(" | ")
    assert (vocab, block, warps, prefetch) == ("32000", "4096", "4", "True")
    assert 32 <= int(registers) <= 255 and int(instructions) > 500
    (sass,) = tmp_path.glob("*.sass")
    assert "EXP2" in sass.read_text() or "MUFU.EX2" in sass.read_text()
