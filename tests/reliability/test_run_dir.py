"""One process per run directory, and a failed start leaves the directory as it was found.

The holder is a real `fastlm train` subprocess; the contenders are `fastlm train` (fresh, --resume and
run.overwrite=true) started while it trains. Nothing of the holder may be deleted or duplicated.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from crash_harness import ROOT, finish, run_dir, start, write_config

from fastlm.commands.main import main
from fastlm.engine.checkpoint import load_latest_checkpoint
from fastlm.engine.objective import SupervisedObjective
from fastlm.engine.trainer import Trainer
from fastlm.logging.jsonl import read_metrics
from fastlm.run_config.loader import load_config
from fastlm.system.run_dir import LOCK_FILE, RunDirError, RunDirLock

TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
        "model.intermediate_size=64", "data.seq_len=16", "data.micro_batch_size=2", "data.source.num_documents=40",
        "trainer.steps=2", "trainer.eval_every=0", "logging.wandb.enabled=false", "logging.progress=false",
        "schedule.warmup_steps=0", "trainer.device=cpu", "trainer.log_every=1"]


def _wait_for_records(path: Path, count: int, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        if path.is_file() and len(path.read_text(encoding="utf-8").splitlines()) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {count} records in {path} after {timeout} s")


@pytest.mark.slow
def test_second_writer_is_refused_and_deletes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """train, --resume and run.overwrite=true while another process trains there: each exits 1 naming
    the holder's pid and host; the holder finishes with every step logged once and its checkpoints intact."""
    config = write_config(tmp_path, "held", steps=400, checkpoint_every=2)
    directory = run_dir(config)
    holder = start(config, resume=False)
    try:
        _wait_for_records(directory / "metrics.jsonl", 3, holder)
        for extra in ([], ["--resume"], ["run.overwrite=true"]):
            assert main(["train", str(config), *extra]) == 1
            stderr = capsys.readouterr().err
            assert f"in use by pid {holder.pid} on host {socket.gethostname()}" in stderr, stderr
            assert "Traceback" not in stderr
    finally:
        holder.send_signal(signal.SIGTERM)
        code, stderr = finish(holder)
    assert code == 0, stderr
    steps = [record["step"] for record in read_metrics(directory / "metrics.jsonl")]
    last = load_latest_checkpoint(directory / "checkpoints").step
    assert steps == list(range(1, last + 1))  # none lost, none twice


def test_lock_is_released_when_the_holder_is_killed(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from fastlm.system.run_dir import RunDirLock; "
         "RunDirLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(60)", str(tmp_path / "run")],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirError, match=f"in use by pid {holder.pid} on host"):
            RunDirLock(tmp_path / "run").acquire()
    finally:
        holder.kill()
        holder.wait()
    with RunDirLock(tmp_path / "run") as lock:  # the kernel dropped the dead holder's lock
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()


@pytest.mark.parametrize("content", ["[" * 4096, '{"pid": ' + "9" * 4000 + "}", "\xff" * 10])
def test_a_held_lock_with_hostile_content_is_one_line(tmp_path: Path, content: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A second `train` reads the holder's lock file within bounds: deep JSON, a 4000-digit pid or bytes
    that are not UTF-8 give the usual one line (exit 1), not a RecursionError traceback."""
    config = write_config(tmp_path, "held", steps=1)
    lock = run_dir(config) / LOCK_FILE
    lock.parent.mkdir(parents=True)
    lock.write_bytes(content.encode("latin-1"))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'rb'); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('held', flush=True); time.sleep(60)", str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert main(["train", str(config)]) == 1
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err
    assert "is in use by another process (its pid is not recorded yet)" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def _fail_first_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: SupervisedObjective, step: int) -> list:
        raise RuntimeError("first batch failed")

    monkeypatch.setattr(SupervisedObjective, "batches", broken)


def test_failed_start_leaves_a_new_directory_absent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    overrides = [f"run.output_dir={tmp_path}/run", *TINY]
    with monkeypatch.context() as patch:
        _fail_first_batch(patch)
        with pytest.raises(RuntimeError, match="first batch failed"):
            Trainer(load_config(None, overrides)).train()
    assert not (tmp_path / "run").exists()
    assert Trainer(load_config(None, overrides)).train().steps == 2  # the plain re-run is not refused


def test_failed_start_leaves_an_existing_directory_as_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = tmp_path / "run"
    (directory / "checkpoints").mkdir(parents=True)
    (directory / "notes.txt").write_text("mine\n")
    overrides = [f"run.output_dir={directory}", *TINY]
    with monkeypatch.context() as patch:
        _fail_first_batch(patch)
        with pytest.raises(RuntimeError, match="first batch failed"):
            Trainer(load_config(None, overrides)).train()
    assert sorted(p.name for p in directory.iterdir()) == ["checkpoints", "notes.txt"]
    assert not any((directory / "checkpoints").iterdir())
    assert (directory / "notes.txt").read_text() == "mine\n"


def test_leftovers_of_a_start_killed_before_its_first_step_do_not_block(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    (directory / "checkpoints" / ".tmp-step-00000001-999").mkdir(parents=True)
    (directory / "metrics.jsonl").write_text("")
    (directory / LOCK_FILE).write_text('{"pid": 999, "host": "gone", "started": 0}')  # not locked by anyone
    summary = Trainer(load_config(None, [f"run.output_dir={directory}", *TINY])).train()
    assert summary.steps == 2
    assert [r["step"] for r in read_metrics(directory / "metrics.jsonl")] == [1, 2]
