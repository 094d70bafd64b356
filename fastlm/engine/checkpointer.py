"""A run's checkpoints from the trainer's side: what a checkpoint holds beside the weights, writing it (gathered
over ranks), and restoring the newest one that verifies and fits (fastlm/engine/checkpoint.py holds the files).
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fastlm.data.datasets import DataError
from fastlm.data.fingerprint import data_fingerprint, describe_change
from fastlm.data.tokenizer import Tokenizer
from fastlm.engine.checkpoint import (
    CheckpointError,
    LoadedCheckpoint,
    load_latest_checkpoint,
    save_checkpoint,
    step_dir_name,
)
from fastlm.engine.distributed import Parallel, full_state, load_full_state
from fastlm.engine.lora_training import check_base, checkpointed, checkpointed_shapes, restore_model
from fastlm.engine.runtime import rng_state, set_rng_state
from fastlm.engine.schedule_resume import DecayAnchor, anchor_for_resume, continue_decay
from fastlm.system.run_dir import ReplacedRun

if TYPE_CHECKING:
    from fastlm.run_config.schema import RunConfig


@dataclass
class Counters:
    """The loop's counters a checkpoint carries."""

    step: int = 0
    skipped_steps: int = 0


class Checkpointer:
    """Saves and restores the model, optimizer, schedule, the objective's data position (`loader`), the RNG and
    the counters. A run that replaced an earlier one (`run.overwrite`) discards it at its first checkpoint."""

    def __init__(self, config: RunConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LambdaLR, loader: Any, parallel: Parallel, device: torch.device,
                 tokenizer: Tokenizer, lora_base: Any, directory: Path, verbose: bool):
        self.config, self.model, self.optimizer, self.scheduler = config, model, optimizer, scheduler
        self.loader, self.parallel, self.lora_base, self.directory = loader, parallel, lora_base, directory
        self.device = device
        self.verbose = verbose
        self.data_fingerprint = data_fingerprint(config.data.source, tokenizer.fingerprint)  # for resume checks
        self.written = 0  # by this process: a start that wrote one is not undone on failure
        self.replaced: ReplacedRun | None = None  # run.overwrite's earlier run, until the first checkpoint
        self.wandb_run_id: str | None = None  # kept in checkpoints: a resume logs to the same wandb run
        self.decay_anchor: DecayAnchor | None = None  # set by a resume that changed trainer.steps (schedule_resume.py)

    def state(self, counters: Counters) -> dict[str, Any]:
        return {
            "step": counters.step,
            "skipped_steps": counters.skipped_steps,
            "scheduler": self.scheduler.state_dict(),
            "data": self.loader.state_dict(),
            "data_fingerprint": self.data_fingerprint,
            "rng": rng_state(),
            "wandb_run_id": self.wandb_run_id,
            "total_steps": self.config.trainer.steps,
            "decay_anchor": None if self.decay_anchor is None else self.decay_anchor.to_state(),
            "lora_base": self.lora_base,
        }

    def save(self, counters: Counters) -> Path:
        """Distributed: every rank helps gather the full state, rank 0 writes it, all wait for the write."""
        args = (self.state(counters), self.config.model_dump(mode="json"), self.config.trainer.keep_checkpoints)
        self.written += 1
        if not self.parallel.distributed:
            path = save_checkpoint(self.directory, counters.step, checkpointed(self.model), self.optimizer, *args)
            self._discard_replaced()
            return path
        model_state, optimizer_state = full_state(self.model, self.optimizer, self.parallel)
        model_state = checkpointed(self.model, model_state)
        if self.parallel.rank == 0:
            save_checkpoint(self.directory, counters.step, model_state, optimizer_state, *args)
        dist.barrier()
        self._discard_replaced()
        return self.directory / step_dir_name(counters.step)

    def _discard_replaced(self) -> None:
        if self.replaced is not None:  # the new run has a checkpoint: the earlier one is not needed back
            self.replaced.discard()
            self.replaced = None

    def resume(self) -> Counters:
        """Restore from the newest checkpoint that verifies and fits this run; each one that does not is skipped
        with the reason."""
        restored: list[Counters] = []
        loaded = load_latest_checkpoint(self.directory, use=lambda checkpoint: restored.append(self._restore(checkpoint)))
        self._continue_schedule(loaded, restored[-1].step)  # once, for the checkpoint restored
        return restored[-1]

    def _check_data(self, loaded: LoadedCheckpoint) -> bool:
        """False when the data changed and `run.accept_changed_data` lets the run go on anyway."""
        stored = loaded.trainer_state.get("data_fingerprint")
        change = describe_change(stored, self.data_fingerprint) if isinstance(stored, dict) else None
        if change is None:
            return True
        if not self.config.run.accept_changed_data:
            raise DataError(f"the training data changed since checkpoint {loaded.path.name}: {change}. Restore the "
                            "data, or pass run.accept_changed_data=true to continue on the new data")
        warnings.warn(f"resuming on changed data ({change}); run.accept_changed_data is set", RuntimeWarning, stacklevel=3)
        return False

    def _restore(self, loaded: LoadedCheckpoint) -> Counters:
        """Apply one verified checkpoint; anything in it that does not fit is a `CheckpointError` (the
        caller falls back to an older one). Changed data is a `DataError`: no older checkpoint helps."""
        loaded.check_fits(checkpointed_shapes(self.config), self.config.model.model_dump(mode="json"))
        same_data = self._check_data(loaded)
        try:
            if self.parallel.distributed:
                if self.lora_base is not None:
                    check_base(loaded, self.lora_base)
                load_full_state(self.model, self.optimizer, loaded.model_state(), loaded.optimizer_state, self.parallel,
                                strict=self.lora_base is None)
            else:
                restore_model(loaded, self.model, self.device, self.lora_base)
                self.optimizer.load_state_dict(loaded.optimizer_state)
            state = loaded.trainer_state
            self.scheduler.load_state_dict(state["scheduler"])
            try:
                self.loader.load_state_dict(state["data"])
            except ValueError:
                if same_data:
                    raise
                warnings.warn("the data order starts over: the changed data has another row count", RuntimeWarning, stacklevel=2)
            set_rng_state(state["rng"])
            counters = Counters(int(state["step"]), int(state["skipped_steps"]))
            self.wandb_run_id = state.get("wandb_run_id")
        except CheckpointError:
            raise
        except Exception as error:  # noqa: BLE001 - a malformed piece of a hostile checkpoint: skip it
            raise CheckpointError(f"{loaded.path}: cannot restore it ({type(error).__name__}: {str(error)[:200]})") from None
        return counters

    def _continue_schedule(self, loaded: LoadedCheckpoint, step: int) -> None:
        """A resume with another trainer.steps continues the lr decay from where the checkpoint left it (instead
        of restarting it for the new total), and says so once."""
        state = loaded.trainer_state
        stored = loaded.config.get("trainer") if isinstance(loaded.config.get("trainer"), dict) else {}
        total, schedule = self.config.trainer.steps, self.config.schedule
        try:  # checkpoints from before these keys hold the total in their config
            old_total = int(state.get("total_steps") or stored.get("steps") or total)
            anchor = DecayAnchor.from_state(state.get("decay_anchor"))
        except (TypeError, ValueError, IndexError) as error:
            raise CheckpointError(f"{loaded.path}: its schedule state is malformed ({error})") from None
        self.decay_anchor = anchor_for_resume(step, old_total, total, schedule, anchor)
        if self.decay_anchor is None:
            return
        continue_decay(self.scheduler, total, schedule, self.decay_anchor)
        if old_total != total and self.verbose and step < total:
            end = self.scheduler.lr_lambdas[0](total) * self.scheduler.base_lrs[0]
            print(f"fastlm: trainer.steps is {total}, the checkpoint's run went to {old_total}: the lr decay continues "
                  f"from step {step} (lr {self.scheduler.get_last_lr()[0]:.3g}) to {end:.3g} at step {total} instead "
                  "of restarting", file=sys.stderr, flush=True)
