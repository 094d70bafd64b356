"""wandb failing to start, or its service process dying mid-run, never stops `fastlm train`: the JSONL keeps
every step and a warning says what happened."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml
from crash_harness import ROOT, finish, logged_steps, run_dir, step_losses, wait_for, write_config

from fastlm.logging.jsonl import read_metrics

STEPS = 40


def _with_wandb(config_path: Path) -> None:
    config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    config["logging"]["wandb"] = {"enabled": True, "mode": "auto", "project": "reliability"}
    config_path.write_text(yaml.safe_dump(config), encoding="utf-8")


def _start(config_path: Path, wandb_mode: str) -> subprocess.Popen[str]:
    # Without WANDB_SERVICE the child starts its own wandb service (with it, wandb would attach to a
    # service an earlier in-process test left running in pytest, and there would be no child to kill).
    inherited = {key: value for key, value in os.environ.items() if key != "WANDB_SERVICE"}
    env = {**inherited, "WANDB_MODE": wandb_mode, "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "fastlm", "train", str(config_path)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _children(pid: int) -> list[int]:
    """Direct child processes (the wandb service), from /proc."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def test_wandb_that_cannot_start_leaves_training_and_jsonl_intact(tmp_path: Path) -> None:
    config = write_config(tmp_path, "nowandb", steps=STEPS, checkpoint_every=0)
    _with_wandb(config)
    status, stderr = finish(_start(config, "no-such-mode"))
    assert status == 0, stderr
    assert "wandb init failed" in stderr
    assert sorted(step_losses(config)) == list(range(1, STEPS + 1))


def test_wandb_service_killed_mid_run(tmp_path: Path) -> None:
    config = write_config(tmp_path, "deadwandb", steps=STEPS, checkpoint_every=0)
    _with_wandb(config)
    process = _start(config, "offline")
    wait_for(lambda: logged_steps(config) >= 2, process, "two logged steps")
    children = _children(process.pid)
    assert children, "no wandb service process to kill"
    for child in children:
        os.kill(child, signal.SIGKILL)
    status, stderr = finish(process)
    assert status == 0, stderr
    assert sorted(step_losses(config)) == list(range(1, STEPS + 1))
    assert stderr.count("wandb log failed") == 1 and "continuing with metrics.jsonl only" in stderr
    records = read_metrics(run_dir(config) / "metrics.jsonl")
    assert all({"train/loss", "train/lr", "train/grad_norm"} <= set(record) for record in records)
