"""Non-finite gradients (with a finite loss) are caught by the configured policy; fp16 is refused by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from crash_harness import ROOT, write_config

from fastlm.config.errors import ConfigError
from fastlm.engine.checkpoint import load_latest_checkpoint
from fastlm.engine.step import NonFiniteError
from fastlm.engine.trainer import Trainer
from fastlm.logging.jsonl import read_metrics
from fastlm.run_config.loader import load_config


def _poison_gradient_at(trainer: Trainer, step: int) -> None:
    """The backward of step `step` (1-based) yields a NaN gradient for one weight; the loss stays finite."""
    weight = trainer.model.final_norm.weight
    weight.register_hook(lambda grad: grad * torch.nan if trainer.step == step - 1 else grad)


def test_nonfinite_gradient_skips_the_step_and_counts_it(tmp_path: Path) -> None:
    trainer = Trainer(load_config(write_config(tmp_path, "skip", steps=3, checkpoint_every=0),
                                  ["trainer.nonfinite=skip_step"]))
    _poison_gradient_at(trainer, 2)
    snapshots = []
    original = trainer.runner.optimizer_step

    def step_and_snapshot(result, step):  # record the weights after every optimizer step
        original(result, step)
        snapshots.append([p.detach().clone() for p in trainer.model.parameters()])

    trainer.runner.optimizer_step = step_and_snapshot
    summary = trainer.train()
    records = read_metrics(summary.run_dir / "metrics.jsonl")
    assert [r["train/skipped_steps"] for r in records] == [0, 1, 1]
    assert all(r["train/loss"] is not None for r in records)  # the loss was finite: only the gradient was not
    assert records[1]["train/grad_norm"] is None and records[2]["train/grad_norm"] is not None
    assert all(torch.equal(a, b) for a, b in zip(snapshots[0], snapshots[1], strict=True))  # step 2 changed nothing
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[1], snapshots[2], strict=True))  # step 3 trained
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_nonfinite_gradient_stop_saves_the_step_before(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, "stop", steps=3, checkpoint_every=0), ["trainer.nonfinite=stop"])
    trainer = Trainer(config)
    _poison_gradient_at(trainer, 2)
    with pytest.raises(NonFiniteError, match=r"non-finite gradient norm at step 2 \(loss \d"):
        trainer.train()
    loaded = load_latest_checkpoint(trainer.checkpoint_dir)
    assert loaded.step == 1  # weights and optimizer from before the bad step
    resumed = Trainer(config)
    assert resumed.train(resume=True).steps == 3


def test_cli_stop_on_divergence_exits_1_with_the_reason(tmp_path: Path) -> None:
    config = write_config(tmp_path, "diverge", steps=5, checkpoint_every=0)
    done = subprocess.run([sys.executable, "-m", "fastlm", "train", str(config), "optimizer.lr=1e30",
                           "optimizer.grad_clip=null", "trainer.nonfinite=stop"], cwd=ROOT, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "fastlm: non-finite" in done.stderr and "saved to" in done.stderr


def test_fp16_is_refused_with_the_choices() -> None:
    """fp16 needs dynamic loss scaling; fastlm trains bf16 (fp32 range) instead, so it rejects fp16 by name."""
    with pytest.raises(ConfigError, match=r"trainer.precision: Input should be 'auto', 'fp32' or 'bf16'.*fp16"):
        load_config(None, ["trainer.precision=fp16"])
