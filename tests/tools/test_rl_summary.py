"""tools/rl_summary.py reads an RL run's metrics.jsonl back into the table the docs quote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_summary_tabulates_reward_and_timing(tmp_path: Path) -> None:
    records = [
        {"step": 5, "train/loss": 2.0, "train/rl/warmup": 1.0, "train/timing/rollout_seconds": 0.0,
         "train/timing/train_seconds": 0.1},
        {"step": 10, "train/loss": 0.5, "train/rl/warmup": 0.0, "train/reward": 0.25, "eval/reward": 0.4,
         "eval/accuracy": 0.3, "train/timing/rollout_seconds": 0.5, "train/timing/train_seconds": 0.2},
        {"step": 15, "train/loss": 0.4, "train/rl/warmup": 0.0, "train/reward": 0.75,
         "train/timing/rollout_seconds": 0.25, "train/timing/train_seconds": 0.2},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "rl_summary.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    assert "| 5 | warm-up | 2.000 | - |" in out
    assert "| 10 | RL | 0.500 | 0.250 | 0.400 | 0.300 |" in out
    assert "first 3 mean 0.500, last 3 mean 0.500" in out  # two RL records: both windows hold both
    assert "eval/reward (greedy): 0.400@10" in out
    assert "RL: 2 records, per step 0.375 s rollout + 0.200 s train" in out
