"""tools/bench_opd.py runs end to end on CPU at the tiny shape: a teacher trained here, then every student arm
(on-policy distillation, gkd, GRPO alone, offline KD) with its eval rewards, timings and the teacher's share."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import bench_opd as bench


@pytest.mark.slow
def test_bench_opd_cpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench_opd.json"
    report = bench.main(["--cpu-smoke", "--out", str(out), "--plot", str(tmp_path / "bench_opd.png")])
    assert [arm["arm"] for arm in report["arms"]] == list(bench.ARMS)
    assert json.loads(out.read_text())["teacher_preset"] == "tiny-llama"
    for arm in report["arms"]:
        assert [step for step, _ in arm["eval_rewards"]] == [0, 1, 2] and arm["tokens_per_second"] > 0
        teacher_share = arm["teacher_share"]
        assert (teacher_share > 0) if arm["arm"] != "grpo" else teacher_share < 0.05, arm
    assert (tmp_path / "bench_opd.png").stat().st_size > 0
