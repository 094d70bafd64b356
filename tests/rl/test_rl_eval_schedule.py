"""The RL trainer's greedy eval runs on `trainer.eval_every`, whatever `trainer.log_every` is (it used to run
only where a log record was written, so eval steps off the log grid were skipped): a real short GRPO run
(warm-up, then rollouts) with eval_every 3 and log_every 2 writes eval/reward at steps 3, 6 and 9."""

from __future__ import annotations

from pathlib import Path

from fastlm.logging.jsonl import read_metrics
from fastlm.run_config.loader import load_config
from fastlm.training.registry import build_trainer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_eval_every_3_with_log_every_2(tmp_path: Path) -> None:
    config = load_config(CONFIGS / "grpo.yaml", [
        f"run.output_dir={tmp_path}/{{name}}", "trainer.steps=9", "trainer.log_every=2", "trainer.eval_every=3",
        "rl.warmup_steps=4", "rl.prompts_per_rollout=4", "rl.eval_prompts=8", "logging.progress=false",
        "logging.wandb.enabled=false",
    ])
    summary = build_trainer(config).train()
    records = read_metrics(summary.run_dir / "metrics.jsonl")
    by_step = {r["step"]: r for r in records}
    print({step: sorted(k for k in r if k.startswith("eval/") or k == "train/reward") for step, r in by_step.items()})
    assert sorted(by_step) == [2, 3, 4, 6, 8, 9]
    assert [r["step"] for r in records if "eval/reward" in r] == [3, 6, 9]
    assert all("eval/accuracy" in by_step[step] for step in (3, 6, 9))
    assert [r["step"] for r in records if "train/loss" in r] == [2, 4, 6, 8, 9]
    assert set(by_step[3]) == {"step", "time", "eval/reward", "eval/accuracy"}  # an eval-only step: no train keys
    assert [step for step, _ in summary.eval_rewards] == [3, 6, 9]
    assert [reward for _, reward in summary.eval_rewards] == [by_step[step]["eval/reward"] for step in (3, 6, 9)]
    assert "train/reward" in by_step[6] and "train/reward" not in by_step[4]  # RL from step 5 on
