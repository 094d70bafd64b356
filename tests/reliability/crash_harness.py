"""Run `python -m fastlm train` as a real subprocess, kill it, resume it, and compare with an uninterrupted run.

Shared by the reliability tests (a handful of kill points) and tools/bench/kill_soak.py (many, for the figures
in docs/reliability.md). Every run is a tiny CPU model with a fixed seed and one thread, so an
uninterrupted run and a killed-and-resumed one must log bit-identical losses.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from fastlm.engine.checkpoint import LATEST_FILE, load_checkpoint, load_latest_checkpoint
from fastlm.system.signals import FAULT_ENV

ROOT = Path(__file__).resolve().parents[2]
FAULT_POINTS = ("checkpoint_files_written", "checkpoint_before_rename", "checkpoint_before_latest")
TIMEOUT_S = 180.0
STEPS = 48  # long enough that a chain of kills (each attempt advances a few steps) never reaches the end




def write_config(directory: Path, name: str, steps: int = STEPS, checkpoint_every: int = 1, keep: int = 2,
                 source: dict | None = None) -> Path:
    """A tiny run (hidden 32, 1 layer, seq_len 32, micro-batch 4) that checkpoints every step; no wandb."""
    config = {
        "run": {"name": name, "output_dir": str(directory / "{name}"), "seed": 0},
        "model": {"type": "llama", "hidden_size": 32, "num_layers": 1, "num_heads": 2, "max_seq_len": 32},
        "data": {"source": source or {"type": "generated", "num_documents": 200}, "seq_len": 32, "micro_batch_size": 4},
        "optimizer": {"lr": 1e-2},
        "schedule": {"warmup_steps": 2},
        "trainer": {"steps": steps, "log_every": 1, "eval_every": 0, "checkpoint_every": checkpoint_every,
                    "keep_checkpoints": keep, "device": "cpu"},
        "logging": {"wandb": {"enabled": False}, "progress": False},
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def run_dir(config_path: Path) -> Path:
    config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    return Path(config["run"]["output_dir"].replace("{name}", config["run"]["name"]))


def _env(fault: str | None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop(FAULT_ENV, None)
    if fault is not None:
        env[FAULT_ENV] = fault
    return env


def start(config_path: Path, resume: bool, fault: str | None = None) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "fastlm", "train", str(config_path), *(["--resume"] if resume else [])]
    return subprocess.Popen(command, cwd=ROOT, env=_env(fault), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish(process: subprocess.Popen[str]) -> tuple[int, str]:
    """Wait for the process; its exit status and stderr."""
    _, stderr = process.communicate(timeout=TIMEOUT_S)
    return process.returncode, stderr


def has_checkpoint(config_path: Path) -> bool:
    return (run_dir(config_path) / "checkpoints" / LATEST_FILE).is_file()


def logged_steps(config_path: Path) -> int:
    """Complete JSONL records so far (a line without its newline is still being written)."""
    path = run_dir(config_path) / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text(encoding="utf-8").splitlines(keepends=True) if line.endswith("\n"))


def wait_for(predicate: callable[[], bool], process: subprocess.Popen[str], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        if process.poll() is not None:
            raise AssertionError(f"training exited ({process.returncode}) before {what}: {process.stderr.read()}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def step_losses(config_path: Path) -> dict[int, float]:
    """train/loss per step from metrics.jsonl; each step must appear once (resume drops re-run steps)."""
    records = [json.loads(line) for line in (run_dir(config_path) / "metrics.jsonl").read_text().splitlines()]
    steps = [record["step"] for record in records]
    assert len(steps) == len(set(steps)), f"duplicate steps in metrics.jsonl: {steps}"
    return {record["step"]: record["train/loss"] for record in records}


def verify_checkpoints(config_path: Path) -> int | None:
    """Every `step-*` directory verifies, the newest loads without falling back; its step (None: none yet)."""
    directory = run_dir(config_path) / "checkpoints"
    complete = sorted(directory.glob("step-*")) if directory.is_dir() else []
    for path in complete:
        load_checkpoint(path)  # raises CheckpointError on a torn or corrupt one
    if not complete:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a skipped (corrupt) candidate would warn
        return load_latest_checkpoint(directory).step


@dataclass
class KillRecord:
    """One kill: how it was placed, the checkpoint it left, and the steps its process had logged."""

    how: str
    exit_status: int
    checkpoint_step: int | None
    logged_before_kill: int
    temp_dirs_left: int


@dataclass
class ChainResult:
    kills: list[KillRecord] = field(default_factory=list)
    losses: dict[int, float] = field(default_factory=dict)


def checkpoint_step(config_path: Path) -> int:
    """The step `latest` names (0 before the first checkpoint)."""
    latest = run_dir(config_path) / "checkpoints" / LATEST_FILE
    return int(latest.read_text(encoding="utf-8").strip().split("-")[1]) if latest.is_file() else 0


def kill_chain(config_path: Path, plan: list[str], seed: int, max_delay_s: float = 0.1,
               startup_s: float = 3.0) -> ChainResult:
    """Run the plan, then resume to the end and return the per-step losses. Each entry is one attempt:

    - a fault point (`name@n`): the process SIGKILLs itself the n-th time it reaches that point;
    - "random": wait until the attempt has checkpointed 1-3 new steps (seeded), then SIGKILL after a random
      delay of up to `max_delay_s`: anywhere in a step, its logging, or its checkpoint write;
    - "startup": SIGKILL a random delay (up to `startup_s`) after launch: imports, resume, JSONL cleanup.

    The plan must start with "random" (it waits for a first checkpoint: a run killed before it has nothing
    to resume). Waiting on checkpoints rather than wall-clock time keeps the kills spread over the run
    whatever the machine's load.
    """
    if plan and plan[0] != "random":
        raise ValueError(f"a kill chain starts with 'random' (it makes the first checkpoint), got {plan[0]!r}")
    rng = random.Random(seed)
    result = ChainResult()
    for how in plan:
        resume = has_checkpoint(config_path)
        fault = how if how not in ("random", "startup") else None
        target = checkpoint_step(config_path) + rng.randint(1, 3)
        process = start(config_path, resume, fault)
        if how == "random":
            wait_for(lambda target=target: checkpoint_step(config_path) >= target, process, f"a checkpoint of step {target}")
            time.sleep(rng.uniform(0.0, max_delay_s))
        elif how == "startup":
            time.sleep(rng.uniform(0.0, startup_s))
        if fault is None:
            process.send_signal(signal.SIGKILL)
        status, stderr = finish(process)
        if status != -signal.SIGKILL:
            raise AssertionError(f"{how}: exited {status} instead of being killed (add steps?): {stderr[-2000:]}")
        temp_dirs = len(list((run_dir(config_path) / "checkpoints").glob(".tmp-*")))
        result.kills.append(KillRecord(how, status, verify_checkpoints(config_path), logged_steps(config_path),
                                       temp_dirs))
    status, stderr = finish(start(config_path, resume=has_checkpoint(config_path)))
    if status != 0:
        raise AssertionError(f"final resume failed ({status}): {stderr[-3000:]}")
    assert not list((run_dir(config_path) / "checkpoints").glob(".tmp-*")), "temp dirs left after a clean save"
    result.losses = step_losses(config_path)
    return result


def reference_losses(directory: Path, steps: int = STEPS) -> dict[int, float]:
    """An uninterrupted run of the same config: the losses every interrupted run must reproduce exactly."""
    config_path = write_config(directory, "reference", steps=steps)
    status, stderr = finish(start(config_path, resume=False))
    if status != 0:
        raise AssertionError(f"reference run failed ({status}): {stderr[-3000:]}")
    return step_losses(config_path)
