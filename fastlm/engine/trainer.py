"""The training loop, the same for every training kind: the objective's micro-batches -> one optimizer step ->
logs, eval, checkpoints.

The trainer builds the model, optimizer and schedule, then the run's `Objective` (fastlm/engine/objective.py;
fastlm/training/registry.py picks it from the config), and runs to `trainer.steps`. Components do the rest:
`StepRunner` (step.py) the gradients, the update decided on the device and the read points; `Meter`
(meter.py) throughput and the log windows' means; `Checkpointer` (checkpointer.py) writing and restoring;
`StopRequest` the signals. Under torchrun (fastlm/engine/distributed.py) the same loop runs on every rank: each
dp rank trains on its rows of the global batch, normalizers and logged scalars are summed over dp, rank 0 logs
and writes the gathered checkpoint.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fastlm.data.tokenizer import build_tokenizer
from fastlm.engine.checkpoint import checkpoint_bytes, complete_checkpoints
from fastlm.engine.checkpointer import Checkpointer, Counters
from fastlm.engine.compile import compile_wanted
from fastlm.engine.distributed import build_parallel, local_device, parallelize
from fastlm.engine.lora_training import setup_lora
from fastlm.engine.meter import Meter
from fastlm.engine.objective import Objective, StepTimes, SupervisedObjective, TrainingParts, TrainSummary
from fastlm.engine.optim import build_optimizer, build_scheduler
from fastlm.engine.preflight import CHECKPOINT_DIR, EARLIER_RUN_FIX, earlier_run
from fastlm.engine.runtime import autocast_dtype, cpu_threads, describe_head, seed_everything, select_device
from fastlm.engine.step import StepRunner
from fastlm.engine.step_scalars import StepResult
from fastlm.logging.jsonl import drop_records_after
from fastlm.logging.logger import METRICS_FILE, MetricLogger
from fastlm.models.decoder import build_model
from fastlm.system.disk_space import ensure_space
from fastlm.system.run_dir import FreshStart, ReplacedRun, RunDirError, RunDirLock, recover_replaced
from fastlm.system.signals import StopRequest

if TYPE_CHECKING:
    from fastlm.run_config.schema import RunConfig

HF_EXPORT_DIR = "hf"  # trainer.export_hf writes the final weights here


class Trainer:
    """Builds everything from a `RunConfig` and the objective's builder; `train()` runs (or resumes) to
    `trainer.steps`."""

    def __init__(self, config: RunConfig, rank: int | None = None,
                 objective: Callable[[TrainingParts], Objective] = SupervisedObjective):
        self.config = config  # checked by the start (the loader's cross_check, the command's preflight), not here
        self.tokenizer = build_tokenizer(config.data.tokenizer, config.run.init_path)  # vocab checked by cross_check
        self.device = local_device(select_device(config.trainer))
        self.parallel = build_parallel(config.distributed, self.device)
        self.rank = self.parallel.rank if self.parallel.distributed else rank
        self.amp_dtype = autocast_dtype(config.trainer, self.device)
        torch.set_num_threads(cpu_threads(config.run.threads))
        seed_everything(config.run.seed)  # the same seed on every rank: identical initial weights
        self.model = build_model(config.model, device=self.device)
        if config.run.init_path is not None:  # a resume overwrites these weights with the checkpoint's
            self._load_init_weights(config.run.init_path)
        self.lora_base = setup_lora(self.model, config, self.device)  # None without model.lora
        self.model.set_memory_savers(config.trainer.activation_checkpointing, config.trainer.activation_offload,
                                     config.trainer.mlp_tile_len)
        data_parallel = self.parallel.data_parallel if self.parallel.dp_size > 1 else None
        if compile_wanted(config.trainer.compile, self.device, data_parallel):
            self.model.compile_blocks()
        # What the step calls: the DDP wrapper, or the model itself (FSDP shards it in place).
        self.train_model = parallelize(self.model, self.parallel, self.device)
        self.optimizer = build_optimizer(self.model, config.optimizer)
        self.run_dir = Path(config.run.directory)
        self.checkpoint_dir = self.run_dir / CHECKPOINT_DIR
        self.step = 0
        self.objective = objective(TrainingParts(config, self.tokenizer, self.model, self.device, self.parallel,
                                                 self.rank, self.amp_dtype, self.run_dir, self.save))
        self.scheduler = build_scheduler(self.optimizer, config.trainer.steps, config.schedule, self.objective.lr_scale)
        self.checkpoints = Checkpointer(config, self.model, self.optimizer, self.scheduler, self.objective.loader,
                                        self.parallel, self.device, self.tokenizer, self.lora_base, self.checkpoint_dir,
                                        verbose=self.rank in (None, 0))
        self.runner = StepRunner(config, self.model, self.train_model, self.optimizer, self.scheduler, self.parallel,
                                 self.device, self.amp_dtype, self.objective.late_reads, self.rank in (None, 0),
                                 self.save)
        self.times = StepTimes()  # the steps since the last log record, for the objective's metrics

    def _load_init_weights(self, path: str) -> None:
        """The starting weights: a fastlm checkpoint's (verified, its model checked against this run's) or a
        Hugging Face folder's (fastlm/engine/init_path.py resolved which one `path` is)."""
        from fastlm.engine.init_path import init_source

        if init_source(path).kind == "hf":
            from fastlm.models.hf import load_hf_weights_into

            load_hf_weights_into(self.model, path)
            return
        from fastlm.engine.frozen import find_checkpoint

        loaded = find_checkpoint(path, "run.init_path")
        expected = {name: tuple(value.shape) for name, value in self.model.state_dict().items()}
        loaded.check_fits(expected, self.config.model.model_dump(mode="json"), init=True)
        loaded.load_model(self.model, self.device)

    def train_step(self) -> StepResult:
        """One optimizer step on the objective's batches through its head."""
        started = time.perf_counter()
        self.model.train()
        batches = self.objective.batches(self.step)
        result = self.runner.forward_backward(batches, self.objective.head(self.step), self.objective.prepare)
        self.runner.optimizer_step(result, self.step + 1)
        self.step += 1
        self.times.seconds += time.perf_counter() - started
        self.times.steps += 1
        return result

    def save(self) -> Path:
        """A checkpoint of the last finished step. Pending steps are read first: a checkpoint never holds the
        weights of a step that failed."""
        self.runner.settle()
        return self.checkpoints.save(Counters(self.step, self.runner.skipped_steps))

    def resume(self) -> None:
        """Restore model, optimizer, schedule, data position and RNG from the newest checkpoint that verifies and
        fits this run (checkpointer.py)."""
        counters = self.checkpoints.resume()
        self.step, self.runner.skipped_steps = counters.step, counters.skipped_steps

    def log_record(self, meter: Meter, step: int) -> dict[str, Any]:
        """The record of the log window ending at `step`: the meter's means and throughput, then the objective's."""
        record = meter.record(self.config.trainer.nonfinite == "skip_step")
        record.update(self.objective.metrics(step, self.times))
        self.times = StepTimes()
        return record

    def _any_rank(self, flag: bool) -> bool:
        """True on every rank if it is true on any (ranks must agree before a collective step)."""
        if not self.parallel.distributed:
            return flag
        value = torch.tensor(float(flag), device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value)

    def _claim_run_dir(self) -> None:
        """A fresh run never mixes with an earlier run's checkpoints or metrics: refuse such a directory,
        or clear them first with `run.overwrite: true` (rank 0 holds the lock, looks and clears)."""
        earlier = earlier_run(self.run_dir) if self.rank in (None, 0) else []
        if self._any_rank(bool(earlier) and not self.config.run.overwrite):
            raise RunDirError(f"run directory {self.run_dir} already holds an earlier run "
                              f"({', '.join(earlier) or 'see rank 0'}); {EARLIER_RUN_FIX}")
        if earlier:  # set aside, not deleted, until this run's first checkpoint (fastlm/system/run_dir.py)
            self.checkpoints.replaced = ReplacedRun.set_aside(self.run_dir, [CHECKPOINT_DIR, METRICS_FILE])

    def train(self, resume: bool = False) -> TrainSummary:
        """Run to `trainer.steps` holding the run directory's lock (rank 0; see fastlm/system/run_dir.py).
        A new run that fails before its first step or checkpoint leaves the directory as it found it."""
        existed = self.run_dir.exists()
        lock = RunDirLock(self.run_dir) if self.rank in (None, 0) else None
        refused: RunDirError | None = None
        try:
            if lock is not None:
                lock.acquire()
        except RunDirError as error:
            refused, lock = error, None
        if self._any_rank(refused is not None):
            raise refused or RunDirError(f"rank 0 could not lock the run directory {self.run_dir}")
        fresh: FreshStart | None = None
        try:
            restored = (recover_replaced(self.run_dir, bool(complete_checkpoints(self.checkpoint_dir)))
                        if lock is not None else None)
            if restored:
                print(f"fastlm: {restored}", file=sys.stderr)
            if resume:
                self.resume()
                if self.step >= self.config.trainer.steps:  # nothing to run: no logger, no wandb run, no writes
                    return self.objective.finish(self._summary(Meter(), None, None, already_finished=True))
                if self.rank in (None, 0) and self.config.logging.jsonl:  # steps past the checkpoint are re-run
                    drop_records_after(self.run_dir / METRICS_FILE, self.step)
            else:
                self._claim_run_dir()
                if lock is not None:
                    fresh = FreshStart(self.run_dir, self.checkpoint_dir, existed, lock)
            if lock is not None:  # a full disk is found now, not after the steps up to the next checkpoint
                ensure_space(self.run_dir, 3 * checkpoint_bytes(self.model), "the next checkpoint (weights + AdamW)",
                             "the previous checkpoint is intact" if resume else "")
            return self.objective.finish(self._train_loop())
        except BaseException:
            if fresh is not None and self.step == 0 and not self.checkpoints.written:
                fresh.undo()
            else:
                fresh = None
            if self.checkpoints.replaced is not None:  # failed before its first checkpoint: the earlier run goes back
                self.checkpoints.replaced.restore()
                self.checkpoints.replaced = None
            raise
        finally:
            if lock is not None:
                lock.release(remove=fresh is not None and fresh.remove_lock)
                if fresh is not None and fresh.remove_directory:
                    self.run_dir.rmdir()

    def _train_loop(self) -> TrainSummary:
        """Run to `trainer.steps`; SIGTERM/SIGINT end it early after a checkpoint (see fastlm/system/signals.py).

        Throughput is wall time between read points (the GPU has finished the steps read there), less
        what the loop does after one (eval, checkpoints, logging), which is not step time."""
        trainer, runner = self.config.trainer, self.runner
        stopped_by, eval_loss = None, None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        meter = Meter()
        if self.rank in (None, 0) and self.config.logging.progress:
            print(self.banner(), file=sys.stderr, flush=True)
        run_config = {**self.config.model_dump(mode="json"), "loss_implementation": describe_head(self.config, self.device)}
        with StopRequest() as stop, MetricLogger(
            self.config.logging, self.run_dir, self.config.run.name, trainer.steps, run_config, self.rank,
            self.checkpoints.wandb_run_id, start_step=self.step,
        ) as logger:
            if logger.wandb is not None and logger.wandb.run_id is not None:
                self.checkpoints.wandb_run_id = logger.wandb.run_id
            clock = time.perf_counter()
            while self.step < trainer.steps:
                self.train_step()
                stopping = self._any_rank(stop.requested)  # every rank stops at the same step if any was signalled
                if stopping:
                    runner.settle()  # everything read now (a late read too), so every record is logged
                read = runner.take_read_values()  # empty unless this step was a read point (or the last one's, late)
                if read:
                    meter.read(read, time.perf_counter() - clock)
                records: dict[int, dict[str, Any]] = {}  # a late read logs the step before this one
                for values in read:
                    meter.append(values)
                    if runner.logs_at(values.step):
                        records[values.step] = self.log_record(meter, values.step)
                if read and runner.logs_at(read[-1].step):
                    meter.reset_window_time()
                if runner.evaluates_at(self.step):
                    scores = self.objective.evaluate(self.step)
                    eval_loss = scores.get("eval/loss")
                    if scores:
                        records.setdefault(self.step, {}).update(scores)
                for step, record in sorted(records.items()):
                    logger.log(step, record)
                if runner.checkpoints_at(self.step) or stopping:
                    path = self.save()
                if stopping and self.step < trainer.steps:
                    stopped_by = stop.signal.name if stop.signal is not None else "a signal on another rank"
                    if self.rank in (None, 0):
                        print(f"fastlm: stopped by {stopped_by} after step {self.step}/{trainer.steps}; checkpoint "
                              f"{path}; continue with --resume", file=sys.stderr, flush=True)
                    break
                if read:
                    clock = time.perf_counter()
        if trainer.export_hf and stopped_by is None and self.rank in (None, 0):
            print(f"fastlm: wrote the Hugging Face folder {self.export_hf()}", file=sys.stderr, flush=True)
        return self._summary(meter, eval_loss, stopped_by)

    def export_hf(self) -> Path:
        """The final checkpoint as a Hugging Face folder (RUN_DIR/hf), through `fastlm convert --to-hf`'s code: read
        from the checkpoint just written, so a sharded or data-parallel run exports the full model as well."""
        from fastlm.engine.convert import load_fastlm
        from fastlm.models.hf import save_hf

        config, state, tokenizer = load_fastlm(self.run_dir)
        return save_hf(config, state, self.run_dir / HF_EXPORT_DIR, tokenizer)

    def banner(self) -> str:
        """What this run is, before its first step: where it writes, the model, the loss path, the device, and
        whether it starts fresh or resumes."""
        from fastlm.models.build import count_parameters

        parameters = count_parameters(self.model)
        steps = self.config.trainer.steps
        start = f"resumed from step {self.step}" if self.step else "fresh start"
        world = f", {self.parallel.world_size} processes" if self.parallel.distributed else ""
        precision = f"{str(self.amp_dtype).removeprefix('torch.')} autocast" if self.amp_dtype is not None else "float32"
        return "\n".join([
            f"fastlm: run {self.config.run.name} in {self.run_dir} ({start}, steps {self.step + 1}-{steps})",
            f"fastlm: model {self.config.model.type}, {parameters / 1e6:.2f} M parameters, on {self.device.type} in {precision}"
            + world,
            f"fastlm: {describe_head(self.config, self.device)}",
        ])

    def _summary(self, meter: Meter, eval_loss: float | None, stopped_by: str | None,
                 already_finished: bool = False) -> TrainSummary:
        losses = meter.losses
        return TrainSummary(
            steps=self.step,
            first_loss=losses[0] if losses else None,
            last_loss=losses[-1] if losses else None,
            tokens_per_second=meter.tokens_per_second,
            skipped_steps=self.runner.skipped_steps,
            eval_loss=eval_loss,
            run_dir=self.run_dir,
            losses=losses,
            stopped_by=stopped_by,
            already_finished=already_finished,
        )
