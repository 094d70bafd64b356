"""`fastlm train` after the config is valid: pick the trainer for the run, train, report.

Under torchrun (RANK / WORLD_SIZE / LOCAL_RANK set) every rank runs this inside a process group
(fastlm/engine/distributed.py); a rank that raises prints its traceback and exits non-zero.
"""

from __future__ import annotations

import sys

from fastlm.config.errors import ConfigError
from fastlm.run_config.schema import RunConfig
from fastlm.data.datasets import DataError
from fastlm.engine.checkpoint import CheckpointError
from fastlm.engine.distributed import run_distributed, torchrun_env
from fastlm.system.disk_space import DiskFullError
from fastlm.engine.preflight import preflight_issues
from fastlm.engine.run_dir import RunDirError
from fastlm.engine.runtime import select_device
from fastlm.engine.trainer import NonFiniteError, TrainSummary
from fastlm.rl.rewards import RewardError


def run_training(config: RunConfig, resume: bool = False) -> int:
    """Train to the end and print a one-line summary; the exit status for the CLI (2: the run cannot start)."""
    issues = preflight_issues(config)  # before any device or process group is set up
    if issues:
        print(ConfigError(issues).render(), file=sys.stderr)
        return 2
    if torchrun_env():
        return run_distributed(lambda: _train(config, resume), config.distributed, select_device(config.trainer))
    return _train(config, resume)


def _train(config: RunConfig, resume: bool) -> int:
    from fastlm.engine.select import trainer_class_for

    try:
        trainer = trainer_class_for(config)(config)
        summary = trainer.train(resume=resume)
    except ConfigError as error:  # found before anything was written: a user mistake, exit 2 like validate
        print(error.render(), file=sys.stderr)
        return 2
    except (NonFiniteError, DataError, CheckpointError, RunDirError, DiskFullError, RewardError) as error:  # says what to fix
        print(f"fastlm: {error}", file=sys.stderr)
        return 1
    if trainer.rank in (None, 0):
        print(describe_summary(summary), file=sys.stderr)
    return 0


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
