"""validate predicts what train refuses about the run directory, and a clean error prints once: from the single
process, or from rank 0 of a real two-process (gloo) job started by `fastlm train --nproc-per-node 2`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fastlm.commands.main import main

ROOT = Path(__file__).resolve().parents[2]
TINY = ["trainer.steps=2", "trainer.eval_every=0", "trainer.checkpoint_every=0", "data.source.num_documents=60",
        "data.seq_len=16", "data.micro_batch_size=2", "model.hidden_size=32", "model.num_layers=1",
        "model.num_heads=2", "model.max_seq_len=16", "logging.wandb.enabled=false", "logging.progress=false"]


def test_validate_refuses_an_earlier_run_as_train_would(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = [str(ROOT / "configs/tiny.yaml"), *TINY, f"run.output_dir={tmp_path}/tiny"]
    assert main(["validate", *run]) == 0  # nothing there yet
    assert main(["validate", "--resume", *run]) == 2
    assert "--resume needs a checkpoint" in capsys.readouterr().err
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "metrics.jsonl").write_text('{"step": 1}\n')
    for command in (["validate"], ["train", "--dry-run"], ["train"], ["train", "--nproc-per-node", "2"]):
        assert main([*command, *run]) == 2, command  # the last one refuses before starting any process
        err = capsys.readouterr().err
        assert err.count("already holds an earlier run (metrics.jsonl)") == 1, err
        assert "Fix: continue it with --resume, choose another run.name, or pass run.overwrite=true" in err
    assert main(["validate", *run, "run.overwrite=true"]) == 0
    capsys.readouterr()


@pytest.mark.slow
def test_a_clean_error_on_every_rank_prints_once_without_a_launcher_traceback(tmp_path: Path) -> None:
    """--resume over a checkpoints/ folder with nothing loadable: the parent's check passes, each rank's trainer
    fails the same way (CheckpointError, exit 1); rank 0 alone prints it, and the job ends in one line."""
    (tmp_path / "tiny" / "checkpoints" / "step-00000001").mkdir(parents=True)
    command = [sys.executable, "-m", "fastlm", "train", "--nproc-per-node", "2", "--resume",
               str(ROOT / "configs/tiny.yaml"), *TINY, f"run.output_dir={tmp_path}/tiny"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    print(done.stderr)
    assert done.returncode == 1
    assert done.stderr.count("fastlm: no usable checkpoint in") == 1
    assert re.search(r"fastlm: the job failed: rank [01] exited with status 1 \(its message is above\)", done.stderr)
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr
