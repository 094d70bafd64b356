"""configs/opd.yaml end to end: the GRPO run trained first is the teacher, the smaller student's greedy eval reward
rises under on-policy distillation and its sampled reverse KL to the teacher falls."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastlm.logging.jsonl import read_metrics
from fastlm.run_config.loader import load_config
from fastlm.training.registry import build_trainer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.slow
def test_opd_student_learns_from_the_grpo_teacher(tmp_path: Path) -> None:
    quiet = [f"run.output_dir={tmp_path}/{{name}}", "logging.progress=false", "logging.wandb.enabled=false"]
    teacher = build_trainer(load_config(CONFIGS / "grpo.yaml", quiet)).train()
    student = build_trainer(load_config(CONFIGS / "opd.yaml", [*quiet, f"rl.teacher.path={teacher.run_dir}"])).train()
    evals = dict(student.eval_rewards)
    start, last = evals[student.rl_start], student.eval_rewards[-1][1]
    kl = [r["train/distill/reverse_kl"] for r in read_metrics(student.run_dir / "metrics.jsonl")
          if "train/distill/reverse_kl" in r]
    print(f"teacher eval {teacher.eval_rewards[-1][1]:.3f}; student eval {start:.3f} as distillation starts -> "
          f"{last:.3f}; reverse KL {kl[0]:.3f} -> {kl[-1]:.3f}")
    assert last > start + 0.1 and kl[-1] < kl[0]
