"""Eval runs on `trainer.eval_every`, whatever `trainer.log_every` is: a real short run logs an eval record at
every eval step, merged into the step's log record where both fall on one step."""

from __future__ import annotations

from collections.abc import Callable

from fastlm.engine.trainer import Trainer
from fastlm.logging.jsonl import read_metrics
from fastlm.run_config.schema import RunConfig


def test_eval_every_3_with_log_every_2(tiny_config: Callable[..., RunConfig]) -> None:
    config = tiny_config("schedule", trainer={"steps": 9, "log_every": 2, "eval_every": 3})
    summary = Trainer(config).train()
    records = read_metrics(summary.run_dir / "metrics.jsonl")
    by_step = {r["step"]: r for r in records}
    print({step: sorted(k for k in r if k.startswith(("eval/", "train/loss"))) for step, r in by_step.items()})
    assert sorted(by_step) == [2, 3, 4, 6, 8, 9]  # log steps 2, 4, 6, 8 and the last; eval steps 3, 6, 9
    assert [r["step"] for r in records if "eval/loss" in r] == [3, 6, 9]
    assert [r["step"] for r in records if "train/loss" in r] == [2, 4, 6, 8, 9]
    assert set(by_step[3]) == {"step", "time", "eval/loss"}  # an eval-only step: no train keys
    assert summary.eval_loss == by_step[9]["eval/loss"]
    assert all(0.0 < r["eval/loss"] < 10.0 for r in records if "eval/loss" in r)
