"""Summarise an RL run's metrics.jsonl as a markdown table: did the reward rise, and where did the time go.

    python tools/rl_summary.py RUN_DIR_OR_METRICS_JSONL

One row per log record: step, phase (warm-up or RL), loss, train/reward (mean of the latest rollout),
greedy eval reward and accuracy, mean completion length, the sampler-vs-trainer log-prob gap, and
`train/timing/{rollout,train}_seconds` (per-step means over the log window). Below it: the first and
last RL rewards and the mean step times of each phase.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastlm.logging.jsonl import read_metrics  # noqa: E402 - after the path fix

COLUMNS = {  # header -> (key, format)
    "loss": ("train/loss", "{:.3f}"),
    "reward": ("train/reward", "{:.3f}"),
    "eval reward": ("eval/reward", "{:.3f}"),
    "eval acc": ("eval/accuracy", "{:.3f}"),
    "mean len": ("train/completions/mean_length", "{:.1f}"),
    "logp gap": ("train/sampling/logp_diff/mean", "{:.1e}"),
    "rollout s": ("train/timing/rollout_seconds", "{:.3f}"),
    "train s": ("train/timing/train_seconds", "{:.3f}"),
}


def summarise(records: list[dict]) -> str:
    steps = [r for r in records if "train/timing/train_seconds" in r]
    if not steps:
        raise SystemExit("no RL step records (train/timing/*) in this metrics file")
    lines = ["| step | phase | " + " | ".join(COLUMNS) + " |", "| --- " * (len(COLUMNS) + 2) + "|"]
    for record in steps:
        phase = "warm-up" if record.get("train/rl/warmup") else "RL"
        cells = [fmt.format(record[key]) if key in record else "-" for key, fmt in COLUMNS.values()]
        lines.append(f"| {record.get('step', '?')} | {phase} | " + " | ".join(cells) + " |")
    rl = [r for r in steps if not r.get("train/rl/warmup")]
    rewards = [r["train/reward"] for r in rl if "train/reward" in r]
    evals = [(r["step"], r["eval/reward"]) for r in records if "eval/reward" in r]
    lines.append("")
    if rewards:
        head, tail = rewards[:3], rewards[-3:]
        lines.append(f"train/reward over {len(rewards)} RL records: first 3 mean {statistics.mean(head):.3f}, "
                     f"last 3 mean {statistics.mean(tail):.3f}")
    if evals:
        lines.append("eval/reward (greedy): " + ", ".join(f"{value:.3f}@{step}" for step, value in evals))
    for name, phase in (("warm-up", [r for r in steps if r.get("train/rl/warmup")]), ("RL", rl)):
        if phase:
            rollout = statistics.mean(r["train/timing/rollout_seconds"] for r in phase)
            train = statistics.mean(r["train/timing/train_seconds"] for r in phase)
            lines.append(f"{name}: {len(phase)} records, per step {rollout:.3f} s rollout + {train:.3f} s train")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="run directory or its metrics.jsonl")
    args = parser.parse_args()
    path = args.run / "metrics.jsonl" if args.run.is_dir() else args.run
    print(summarise(read_metrics(path)))


if __name__ == "__main__":
    main()
