"""tools/bench_rl.py runs end to end on CPU at the tiny shape (the fastlm side; the GPU run adds TRL)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import bench_rl as bench


def test_bench_rl_cpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench_rl.json"
    (row,) = bench.main(["--cpu-smoke", "--no-trl", "--out", str(out)])
    assert row["framework"] == "fastlm" and row["preset"] == "tiny-llama" and row["timed_steps"] == 2
    phases = [row[f"{phase}_seconds"] for phase in bench.PHASES]
    assert all(seconds >= 0 for seconds in phases) and row["rollout_seconds"] > 0 and row["train_seconds"] > 0
    assert abs(sum(phases) - row["step_seconds"]) < 1e-9
    for rate in ("rollout_tokens_per_second", "training_tokens_per_second", "episode_tokens_per_second"):
        assert row[rate] > 0
    assert row["episode_tokens_per_second"] < row["rollout_tokens_per_second"]
    assert len(row["rewards"]) == 2 and json.loads(out.read_text())[0]["preset"] == "tiny-llama"


def test_bench_rl_ignore_eos_samples_the_whole_budget() -> None:
    """--ignore-eos: after the warm-up (whose demonstrations stop) every completion runs to --new-tokens."""
    (row,) = bench.main(["--cpu-smoke", "--no-trl", "--ignore-eos"])
    group, prompts, new_tokens = 2, 2, 16  # the smoke shape
    assert row["completion_tokens_per_step"] == group * prompts * new_tokens
