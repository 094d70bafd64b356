"""Late reads: a read point that only logs starts its transfer and waits for it one step later (after the
next step is queued), so the GPU is not left idle there. CUDA turns them on; these tests turn them on for
CPU trainers (`trainer.runner.late_reads = True`) to check the bookkeeping: the same records as on-time reads,
errors raised one step later with every update since held back, nothing read back in between."""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Callable

import pytest
import torch
from host_reads import host_reads
from test_trainer import _LateBadLabel

from fastlm.data.batch import Batch
from fastlm.engine.checkpoint import load_latest_checkpoint
from fastlm.engine.objective import SupervisedObjective
from fastlm.engine.optim import build_scheduler
from fastlm.engine.step import NonFiniteError
from fastlm.engine.trainer import Trainer
from fastlm.logging.jsonl import read_metrics
from fastlm.run_config.schema import RunConfig


def _late(trainer: Trainer) -> Trainer:
    trainer.runner.late_reads = True
    return trainer


def _weights(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_late_reads_log_the_same_records_as_on_time_reads(tiny_config: Callable[..., RunConfig]) -> None:
    """8 steps, a log every 2 and an eval every 4: steps 2 and 6 are read late. The records equal an on-time
    run's (time and throughput aside), each at its own step with the learning rate its update used."""
    sections = {"trainer": {"steps": 8, "log_every": 2, "eval_every": 4}}
    on_time = Trainer(tiny_config("on-time", **sections))
    late = _late(Trainer(tiny_config("late", **sections)))
    assert [step for step in range(1, 9) if late.runner.read_late_at(step)] == [2, 6]
    config = late.config
    parameter = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([parameter], lr=config.optimizer.lr)
    schedule = build_scheduler(optimizer, config.trainer.steps, config.schedule)
    expected_lr = []  # the lr of steps 1..8, from a scheduler of its own
    for _ in range(8):
        expected_lr.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    records = {}
    for name, trainer in (("on time", on_time), ("late", late)):
        summary = trainer.train()
        records[name] = read_metrics(summary.run_dir / "metrics.jsonl")
        print(f"{name}: steps {[r['step'] for r in records[name]]}, loss {[round(r['train/loss'], 4) for r in records[name]]}")
        assert len(summary.losses) == 8
    assert [r["step"] for r in records["late"]] == [2, 4, 6, 8]
    assert [r["train/step"] for r in records["late"]] == [2, 4, 6, 8]
    assert [r["train/lr"] for r in records["late"]] == [expected_lr[step - 1] for step in (2, 4, 6, 8)]
    assert "eval/loss" in records["late"][1] and "eval/loss" in records["late"][3]
    volatile = {"time", "train/tokens_per_second"}
    for a, b in zip(records["on time"], records["late"], strict=True):
        assert {k: v for k, v in a.items() if k not in volatile} == {k: v for k, v in b.items() if k not in volatile}


def test_a_late_read_is_waited_for_inside_the_next_step_only(tiny_config: Callable[..., RunConfig],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = _late(Trainer(tiny_config("late-reads", trainer={"steps": 8, "log_every": 4, "grad_accumulation": 2})))
    for _ in range(3):
        trainer.train_step()
    with host_reads(monkeypatch) as reads:
        trainer.train_step()
    print(f"step 4 (late read point): {reads}")
    assert sum(reads.sites.values()) == 0 and trainer.runner.in_flight is not None, str(reads)
    assert trainer.runner.take_read_values() == []
    with host_reads(monkeypatch) as reads:
        trainer.train_step()
    print(f"step 5 (waits for step 4's transfer): {reads}")
    assert reads.at("engine/step_scalars.py", "wait") == 1 and sum(reads.sites.values()) == 1, str(reads)
    assert [values.step for values in trainer.runner.take_read_values()] == [1, 2, 3, 4]
    assert trainer.runner.in_flight is None and len(trainer.runner.pending) == 1


class _BadFromStepTwo(_LateBadLabel):
    """A label outside the vocabulary from step 2 on, after the host check: only the loss's checks see it."""

    def prepare(self, batch: Batch) -> Batch:
        return super().prepare(batch) if self.step >= 1 else SupervisedObjective.prepare(self, batch)


def test_a_late_read_raises_the_bad_step_with_every_update_since_held_back(
        tiny_config: Callable[..., RunConfig]) -> None:
    """Read points every 4 steps, a bad label from step 2: step 4's read is late, so step 5 is queued (and
    makes no update) before the read raises the loss's error naming step 2; the weights are step 1's."""
    trainer = _late(Trainer(tiny_config("late-bad", trainer={"steps": 8, "log_every": 4}), objective=_BadFromStepTwo))
    trainer.train_step()
    after_first = _weights(trainer)
    for _ in range(3):
        trainer.train_step()  # steps 2-4: held back, step 4's read in flight
    assert trainer.step == 4 and trainer.runner.in_flight is not None
    with pytest.raises(ValueError, match=r"step 2: targets.labels\[\d+\] = 260 is outside the vocabulary"):
        trainer.train_step()
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), after_first))
    assert not trainer.runner.halted and len(trainer.runner.pending) == 0


def test_a_late_nonfinite_stop_saves_the_weights_before_it(tiny_config: Callable[..., RunConfig]) -> None:
    """`nonfinite: stop`, a read every 3 steps (late), a NaN gradient at step 2: steps 2-4 make no update; the
    read inside step 4 names step 2 and the steps held back, and the checkpoint holds step 1's weights."""
    trainer = _late(Trainer(tiny_config("stop-late", trainer={"steps": 8, "log_every": 3, "nonfinite": "stop"})))
    weight = trainer.model.final_norm.weight
    weight.register_hook(lambda grad: grad * math.nan if trainer.step == 1 else grad)
    trainer.train_step()
    after_first = _weights(trainer)
    with pytest.raises(NonFiniteError, match=r"non-finite gradient norm at step 2 .*saved to .*; steps 3-4 made no update"):
        trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), after_first))
    loaded = load_latest_checkpoint(trainer.checkpoint_dir)
    saved = loaded.model_state()
    assert all(torch.equal(saved[name], p) for (name, _), p in zip(trainer.model.named_parameters(), after_first))


def test_late_reads_count_skipped_steps_per_record(tiny_config: Callable[..., RunConfig]) -> None:
    """`nonfinite: skip_step` with a log every step: a late read that finds a skipped step reads the next
    one too; each record still counts the skips up to its own step."""
    trainer = _late(Trainer(tiny_config("skip-late", trainer={"steps": 4, "nonfinite": "skip_step"})))
    with torch.no_grad():
        trainer.model.final_norm.weight[0] = math.nan  # every logit, and every loss, NaN
    summary = trainer.train()
    records = read_metrics(summary.run_dir / "metrics.jsonl")
    assert summary.skipped_steps == 4
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["train/skipped_steps"] for r in records] == [1, 2, 3, 4]


def test_a_stop_right_after_a_late_read_point_still_logs_it(tiny_config: Callable[..., RunConfig]) -> None:
    """A stop request (SIGTERM) at step 5, just after step 4's late read point: step 4's record is logged,
    the checkpoint is step 5's, every loss is in the summary."""

    class StopAtFive(SupervisedObjective):
        def batches(self, step: int) -> list[Batch]:
            if step == 4:  # during step 5: the loop sees the request after it
                os.kill(os.getpid(), signal.SIGTERM)
            return super().batches(step)

    trainer = _late(Trainer(tiny_config("stop-after-late", trainer={"steps": 8, "log_every": 4}), objective=StopAtFive))
    summary = trainer.train()
    records = read_metrics(summary.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [4]
    assert summary.stopped_by is not None and len(summary.losses) == 5
    assert load_latest_checkpoint(trainer.checkpoint_dir).step == 5
