"""A resumed run logs to the same wandb run (real offline runs); resuming a finished run creates nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fastlm.commands.main import main
from fastlm.engine.checkpoint import load_latest_checkpoint
from fastlm.engine.trainer import Trainer
from fastlm.run_config.loader import load_config


def _config_file(tmp_path: Path) -> Path:
    config = {
        "run": {"name": "resumed", "output_dir": str(tmp_path / "run")},
        "model": {"type": "llama", "hidden_size": 32, "num_layers": 1, "num_heads": 2, "max_seq_len": 32},
        "data": {"source": {"type": "generated", "num_documents": 60}, "seq_len": 32, "micro_batch_size": 4},
        "trainer": {"steps": 4, "log_every": 1, "eval_every": 0, "checkpoint_every": 2},
        "logging": {"wandb": {"mode": "offline", "project": "fastlm-test"}, "progress": False},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def _offline_runs(run_dir: Path) -> list[str]:
    """The wandb run id of every offline run directory (offline-run-<date>_<time>-<id>, with a "-N" suffix
    when a resume starts within the same second), in creation order."""
    return [path.name.split("-")[3] for path in sorted((run_dir / "wandb").glob("offline-run-*"))]


def test_resume_continues_the_wandb_run_and_a_finished_run_is_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_file = _config_file(tmp_path)
    run_dir = tmp_path / "run"
    Trainer(load_config(config_file, ["trainer.steps=2"])).train()  # as if stopped after step 2's checkpoint
    (first_id,) = _offline_runs(run_dir)
    assert load_latest_checkpoint(run_dir / "checkpoints").trainer_state["wandb_run_id"] == first_id

    assert main(["train", str(config_file), "--resume"]) == 0
    assert "done: 4 steps" in capsys.readouterr().err
    ids = _offline_runs(run_dir)
    print("wandb offline runs:", ids)
    assert ids == [first_id, first_id], "the resume must log to the same wandb run id"
    assert load_latest_checkpoint(run_dir / "checkpoints").trainer_state["wandb_run_id"] == first_id

    # wandb's service may still append to its own logs of the finished runs: compare paths, and our files' bytes.
    paths, metrics = set(run_dir.rglob("*")), (run_dir / "metrics.jsonl").read_bytes()
    checkpoints = {p: p.read_bytes() for p in (run_dir / "checkpoints").rglob("*") if p.is_file()}
    assert main(["train", str(config_file), "--resume"]) == 0
    err = capsys.readouterr().err
    print(err)
    assert "run already finished" in err and "step 4" in err
    assert set(run_dir.rglob("*")) == paths, "nothing created (no new wandb run)"
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics
    assert {p: p.read_bytes() for p in (run_dir / "checkpoints").rglob("*") if p.is_file()} == checkpoints
