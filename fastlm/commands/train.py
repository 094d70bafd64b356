"""`fastlm train` after the config is valid: check the start, pick the trainer for the run, train, report.

Under torchrun (RANK / WORLD_SIZE / LOCAL_RANK set) every rank runs this inside a process group
(fastlm/engine/distributed.py); a rank that raises prints its traceback and exits non-zero. A clean error
(a config or run-directory problem, a named data or checkpoint failure) is the same on every rank, so only
rank 0 prints it. torchrun itself then adds its ChildFailedError report; `fastlm train --nproc-per-node N`
starts the processes without it: it checks the config once, runs torchrun's launcher in-process and ends a
failed job with one line.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from fastlm.commands.errors import RUN_TIME, exit_status
from fastlm.config.errors import ConfigError
from fastlm.data.datasets import DataError
from fastlm.engine.checkpoint import CheckpointError
from fastlm.engine.distributed import run_distributed, torchrun_env
from fastlm.engine.objective import TrainSummary
from fastlm.engine.preflight import preflight_issues, run_dir_issues
from fastlm.engine.runtime import select_device
from fastlm.engine.step import NonFiniteError
from fastlm.rl.rewards import RewardError
from fastlm.run_config.schema import RunConfig
from fastlm.system.disk_space import DiskFullError
from fastlm.system.run_dir import RunDirError
from fastlm.training.registry import build_trainer


def run_training(config: RunConfig, resume: bool = False) -> int:
    """Train to the end and print a one-line summary; the exit status for the CLI (2: the run cannot start)."""
    status = _start_checks(config, resume)  # before any device or process group
    if status is not None:
        return status
    if torchrun_env():
        return run_distributed(lambda: _train(config, resume), config.distributed, select_device(config.trainer))
    return _train(config, resume)


def _start_checks(config: RunConfig, resume: bool) -> int | None:
    """The start's checks of the machine, files and run directory, reported: None to go on, else the exit
    status (2: a config problem; 1: a planted lock, the trainer's own line and status)."""
    try:
        issues = [*preflight_issues(config), *run_dir_issues(config, resume)]
    except RunDirError as error:
        return exit_status(error, RUN_TIME)
    if issues:
        return exit_status(ConfigError(issues))
    return None


def _train(config: RunConfig, resume: bool) -> int:
    try:
        trainer = build_trainer(config)
        summary = trainer.train(resume=resume)
    except ConfigError as error:  # found before anything was written: a user mistake, exit 2 like validate
        return exit_status(error)
    except (NonFiniteError, DataError, CheckpointError, RunDirError, DiskFullError, RewardError) as error:  # says what to fix
        return exit_status(error, RUN_TIME)
    if trainer.rank in (None, 0):
        print(describe_summary(summary), file=sys.stderr)
    return 0




def launch_processes(config: RunConfig, processes: int, argv: Sequence[str]) -> int:
    """`fastlm train --nproc-per-node N ...`: check the config and run directory once, then start N ranks of the
    same command through torchrun's launcher (single node, a free port). A failed rank has printed its error;
    the job ends with one line naming it and that rank's exit status, not torchrun's ChildFailedError report."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    resume = "--resume" in argv
    with _job_environment(processes):  # the checks see the job's world, as each rank's own checks will
        status = _start_checks(config, resume)
    if status is not None:
        return status
    worker = _without_option(list(argv), "--nproc-per-node")
    launcher = get_args_parser().parse_args(["--standalone", "--nproc-per-node", str(processes), "-m", "fastlm", *worker])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // processes)))
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # the ranks say what failed
    try:
        run(launcher)
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        return exit_status(f"the job failed: rank {rank} exited with status {failure.exitcode} (its message is above)",
                           failure.exitcode if failure.exitcode > 0 else RUN_TIME)
    return 0


@contextmanager
def _job_environment(processes: int) -> Iterator[None]:
    """WORLD_SIZE and LOCAL_WORLD_SIZE of the single-node job about to start, for the launcher's checks only."""
    names = ("WORLD_SIZE", "LOCAL_WORLD_SIZE")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(dict.fromkeys(names, str(processes)))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _without_option(argv: list[str], option: str) -> list[str]:
    """`argv` less `option VALUE` / `option=VALUE`."""
    kept: list[str] = []
    skip = False
    for item in argv:
        if skip:
            skip = False
        elif item == option:
            skip = True
        elif not item.startswith(f"{option}="):
            kept.append(item)
    return kept


def describe_summary(summary: TrainSummary) -> str:
    def number(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.4f}"

    if summary.already_finished:
        return (f"run already finished: its checkpoint is at step {summary.steps}, trainer.steps is reached; nothing to do "
                f"(outputs in {summary.run_dir}; raise trainer.steps to train further)")
    ending = "done" if summary.stopped_by is None else f"stopped early by {summary.stopped_by}"
    evaluated = "" if summary.eval_loss is None else f"eval/loss {number(summary.eval_loss)}, "  # RL runs have none
    return (
        f"{ending}: {summary.steps} steps, train/loss {number(summary.first_loss)} -> {number(summary.last_loss)}, "
        f"{evaluated}{summary.tokens_per_second:,.0f} tokens/s, "
        f"{summary.skipped_steps} skipped steps; outputs in {summary.run_dir}"
    )
