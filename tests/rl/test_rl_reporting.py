"""What an RL user sees and sets: reward on the progress line, no 'eval/loss n/a' in the summary, rl.lr_scale."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from fastlm.commands.train import describe_summary
from fastlm.engine.objective import TrainSummary
from fastlm.engine.optim import lr_multiplier
from fastlm.logging.progress import ProgressLine
from fastlm.run_config.schema import RunConfig
from fastlm.training.registry import build_trainer


def test_progress_line_shows_rewards_when_logged() -> None:
    stream = io.StringIO()
    progress = ProgressLine(total_steps=9, stream=stream)
    progress.log(4, {"train/loss": 0.5, "train/reward": 0.4321, "train/lr": 1e-3})
    progress.log(5, {"train/loss": 0.25, "train/reward": 0.5, "eval/reward": 0.75})
    progress.log(6, {"train/loss": 0.125})  # a warm-up step: no reward shown
    assert stream.getvalue().splitlines() == [
        "step 4/9 | loss 0.5000 | reward 0.432 | lr 1.00e-03",
        "step 5/9 | loss 0.2500 | reward 0.500 | eval reward 0.750",
        "step 6/9 | loss 0.1250",
    ]


@pytest.mark.parametrize("eval_loss", [None, 1.5])
def test_summary_names_eval_loss_only_when_there_is_one(eval_loss: float | None, tmp_path: Path) -> None:
    summary = TrainSummary(steps=3, first_loss=2.0, last_loss=1.0, tokens_per_second=10.0, skipped_steps=0,
                           eval_loss=eval_loss, run_dir=tmp_path)
    line = describe_summary(summary)
    assert line.startswith("done: 3 steps, train/loss 2.0000 -> 1.0000, ")
    assert ("eval/loss 1.5000, " in line) == (eval_loss is not None) and "n/a" not in line


def test_lr_scale_applies_from_the_first_rl_step(tmp_path: Path) -> None:
    config = RunConfig.model_validate({
        "run": {"output_dir": str(tmp_path / "{name}")},
        "model": {"type": "llama", "hidden_size": 32, "num_layers": 1, "num_heads": 2},
        "optimizer": {"lr": 2e-3},
        "schedule": {"warmup_steps": 2, "decay": "cosine", "min_lr_ratio": 0.1},
        "trainer": {"steps": 10},
        "rl": {"warmup_steps": 4, "lr_scale": 0.25},
    })
    trainer = build_trainer(config)  # the schedule times the RL objective's lr_scale
    optimizer, scheduler = trainer.optimizer, trainer.scheduler
    seen = []
    for step in range(config.trainer.steps):
        want = 2e-3 * lr_multiplier(step, 10, config.schedule) * (0.25 if step >= 4 else 1.0)
        seen.append(optimizer.param_groups[0]["lr"])
        assert seen[-1] == pytest.approx(want, rel=1e-12), step
        optimizer.step()
        scheduler.step()
    assert seen[4] < 0.3 * seen[3]  # the drop at the first RL step


def test_summary_names_the_eval_as_rl_starts_and_the_rl_only_gain(tmp_path: Path) -> None:
    from fastlm.rl.objective import RLSummary, describe_rl

    summary = RLSummary(steps=160, first_loss=2.0, last_loss=0.1, tokens_per_second=1.0, skipped_steps=0, eval_loss=None,
                        run_dir=tmp_path, rewards=[0.2, 0.3, 0.4, 0.6], eval_rewards=[(10, 0.0), (60, 0.25), (160, 0.75)],
                        rl_start=60)
    assert describe_rl(summary).splitlines()[-1] == (
        "rl: eval/reward (greedy) 0.000 at step 10 -> 0.250 as RL starts (step 60) -> 0.750 at step 160 (RL: +0.500)")
