"""The training loop: micro-batches -> one optimizer step with step-wide normalizers -> logs, eval, checkpoints.

The step is split into overridable pieces so other engines (GRPO rollouts) can reuse the loop:
`micro_batches()` decides what one step trains on, `loss_head` which head computes its loss,
`forward_backward()` turns it into gradients and summed scalars, `optimizer_step()` clips, checks and
applies them. What the loop logs is overridable too: `log_record()` every `trainer.log_every` steps,
`eval_record()` every `trainer.eval_every` steps, each on its own schedule.

The host never waits for the GPU inside a step: the step's scalars stay on the device and its checks
decide on the device (fastlm/engine/step_scalars.py). They are read back in one transfer at the next
read point (a step that logs, evaluates or checkpoints, and the last), which raises what was found. A
read point that only logs is read late: the host queues the next step before it waits for the transfer.

Under torchrun (fastlm/engine/distributed.py) the same loop runs on every rank: each dp rank trains on
its rows of the global batch, normalizers and logged scalars are summed over dp, rank 0 logs and writes
the gathered checkpoint.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fastlm.data.batch import Batch
from fastlm.data.datasets import DataError
from fastlm.data.eval_source import build_run_loaders
from fastlm.data.fingerprint import data_fingerprint, describe_change
from fastlm.data.loader import BatchLoader
from fastlm.data.summary import eval_repeat_note
from fastlm.data.tokenizer import Tokenizer, build_tokenizer
from fastlm.engine.checkpoint import (
    CheckpointError,
    LoadedCheckpoint,
    checkpoint_bytes,
    complete_checkpoints,
    load_latest_checkpoint,
    save_checkpoint,
    step_dir_name,
)
from fastlm.engine.compile import CompileFallback, compile_wanted
from fastlm.engine.distributed import (
    RankShardLoader,
    build_parallel,
    clip_grad_norm,
    full_state,
    gradient_sync,
    load_full_state,
    local_device,
    parallelize,
    sum_over,
)
from fastlm.engine.lora_training import check_base, checkpointed, checkpointed_shapes, restore_model, setup_lora
from fastlm.engine.optim import build_optimizer, build_scheduler, clip_divisor, fused_update, step_unless
from fastlm.engine.preflight import CHECKPOINT_DIR, EARLIER_RUN_FIX, earlier_run
from fastlm.engine.runtime import (
    autocast_dtype,
    cpu_threads,
    describe_head,
    rng_state,
    seed_everything,
    select_device,
    set_rng_state,
)
from fastlm.engine.schedule_resume import DecayAnchor, anchor_for_resume, continue_decay
from fastlm.engine.step_scalars import InFlightRead, PendingSteps, StepResult, StepValues, window_mean
from fastlm.layers.lm_head import LMHead
from fastlm.logging.jsonl import drop_records_after
from fastlm.logging.logger import METRICS_FILE, MetricLogger
from fastlm.losses.spec import LossNormalizers, LossResult
from fastlm.losses.validation import ValueCheck, collected_value_checks, deferred_value_checks
from fastlm.models.decoder import build_model
from fastlm.system.device import autocast
from fastlm.system.disk_space import ensure_space
from fastlm.system.run_dir import FreshStart, ReplacedRun, RunDirError, RunDirLock, recover_replaced
from fastlm.system.signals import StopRequest

if TYPE_CHECKING:
    from fastlm.run_config.schema import RunConfig

HF_EXPORT_DIR = "hf"  # trainer.export_hf writes the final weights here


class NonFiniteError(RuntimeError):
    """Training met a non-finite loss or gradient with `trainer.nonfinite: stop`."""


@dataclass
class TrainSummary:
    steps: int
    first_loss: float | None
    last_loss: float | None
    tokens_per_second: float
    skipped_steps: int
    eval_loss: float | None
    run_dir: Path
    losses: list[float] = field(default_factory=list)  # train/loss of every step this call ran
    stopped_by: str | None = None  # the signal that ended the run early (a checkpoint of `steps` was written)
    already_finished: bool = False  # a --resume of a run whose checkpoint is at trainer.steps: nothing ran


def step_normalizers(batches: Iterable[Batch]) -> LossNormalizers:
    """Unmasked labels, documents, loss calls and input positions other than padding (the MoE router losses'
    tokens) over every micro-batch of the step, counted before any forward."""
    batches = list(batches)
    return LossNormalizers(
        tokens=float(sum(b.num_tokens for b in batches)),
        documents=float(sum(b.num_documents for b in batches)),
        micro_batches=float(len(batches)),
        positions=float(sum(b.num_positions for b in batches)),
    )


def _accumulate(total: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> None:
    for name, value in values.items():
        total[name] = total[name] + value.detach() if name in total else value.detach()


def _held_back(failed: int, last: int) -> str:
    """The steps after a failed one that ran before the read point found it, their updates held back."""
    if last == failed:
        return ""
    return f"; step {last} made no update" if last == failed + 1 else f"; steps {failed + 1}-{last} made no update"


class Trainer:
    """Builds everything from a `RunConfig`; `train()` runs (or resumes) to `trainer.steps`."""

    late_reads = True  # log-only read points on CUDA wait for their scalars one step later (see optimizer_step)

    def __init__(self, config: RunConfig, rank: int | None = None):
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
        self.compile_fallback = CompileFallback(self.model, verbose=self.rank in (None, 0))
        # What forward_backward calls: the DDP wrapper, or the model itself (FSDP shards it in place).
        self.train_model = parallelize(self.model, self.parallel, self.device)
        self.optimizer = build_optimizer(self.model, config.optimizer)
        self.scheduler = build_scheduler(self.optimizer, config.trainer.steps, config.schedule)
        self.train_loader, eval_loader = self.build_loaders(self.tokenizer)
        self.data_fingerprint = data_fingerprint(config.data.source, self.tokenizer.fingerprint)  # for resume checks
        self.eval_set = (
            [eval_loader.next_batch() for _ in range(config.trainer.eval_batches)] if eval_loader is not None else []
        )
        self.run_dir = Path(config.run.directory)
        self.checkpoint_dir = self.run_dir / CHECKPOINT_DIR
        self.step = 0
        self.skipped_steps = 0
        self.pending = PendingSteps()  # steps whose scalars are not read yet
        self.in_flight: InFlightRead | None = None  # a log-only read point's transfer, waited for a step later
        # On CPU the host runs the step itself: there is no queue to keep fed, so every read is on time.
        self.late_reads = self.late_reads and self.device.type == "cuda"
        self.read_values: list[StepValues] = []  # read by the last read point, for the loop to log
        self.halted = torch.zeros((), dtype=torch.bool, device=self.device)  # a failure holds every update back
        self.checkpoints_written = 0  # by this process: a start that wrote one is not undone on failure
        self.replaced: ReplacedRun | None = None  # run.overwrite's earlier run, until the first checkpoint
        self.wandb_run_id: str | None = None  # kept in checkpoints: a resume logs to the same wandb run
        self.decay_anchor: DecayAnchor | None = None  # set by a resume that changed trainer.steps (schedule_resume.py)

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

    def build_loaders(self, tokenizer: Tokenizer) -> tuple[Any, BatchLoader | None]:
        """The train data source (`next_batch`, `state_dict`, `load_state_dict`) and the eval loader; RL overrides it.

        Data parallel: batches of micro_batch_size * dp from the same seeded order, each dp rank keeping
        its rows (rank-strided), so the global batch is the single-process batch of that size.
        """
        dp = self.parallel.dp_size
        data = self.config.data
        if dp > 1:
            data = data.model_copy(update={"micro_batch_size": data.micro_batch_size * dp})
        train, evaluation = build_run_loaders(data, self.config.run.seed, tokenizer)
        trainer = self.config.trainer
        rows = getattr(evaluation, "rows", None)  # a prepared blend's eval loader draws rows by weight: no count
        note = eval_repeat_note(len(rows), trainer.eval_batches * data.micro_batch_size, data.micro_batch_size) if (
            rows is not None and trainer.eval_every) else None
        if note and self.rank in (None, 0):
            print(f"fastlm: {note}", file=sys.stderr, flush=True)
        if dp == 1:
            return train, evaluation
        rank = self.parallel.dp_rank
        return RankShardLoader(train, rank, dp), None if evaluation is None else RankShardLoader(evaluation, rank, dp)

    def step_normalizers(self, batches: list[Batch]) -> LossNormalizers:
        """`step_normalizers` of this rank's batches, summed over the data-parallel ranks."""
        local = step_normalizers(batches)
        if self.parallel.dp_group is None:
            return local
        counts = {name: torch.tensor(getattr(local, name)) for name in ("tokens", "documents", "micro_batches", "positions")}
        summed = sum_over({k: v.to(self.device) for k, v in counts.items()}, self.parallel.dp_group)
        return LossNormalizers(**{name: float(value) for name, value in summed.items()})

    # --- one step, in overridable pieces -------------------------------------------------------------
    def micro_batches(self) -> list[Batch]:
        """What this step trains on: `grad_accumulation` batches from the packed corpus."""
        return [self.train_loader.next_batch() for _ in range(self.config.trainer.grad_accumulation)]

    @property
    def loss_head(self) -> LMHead:
        """The head this step's loss runs through: the model's own (the RL trainer switches by phase)."""
        return self.model.head

    def prepare(self, batch: Batch) -> Batch:
        """One micro-batch, on the device (an asynchronous copy), just before its forward: the hook for
        per-batch extras (a teacher's logits) so they live for one micro-batch, not the whole step."""
        return batch.to(self.device)

    def forward_backward(self, batches: list[Batch]) -> StepResult:
        """Backward every micro-batch against step-wide normalizers, so gradients add up to one big batch.

        Data parallel: each rank's loss is its share of the global mean; DDP/FSDP average gradients over
        dp, so the backward is scaled by dp to make the reduced gradient the global sum. Nothing is read
        back: the loss-input checks are collected for the next read point.
        """
        normalizers = self.step_normalizers(batches)
        if normalizers.tokens == 0:
            raise ValueError("this step's micro-batches have no unmasked labels; check the data (all prompt?)")
        scale = float(self.parallel.dp_size)
        head = self.loss_head
        loss_sum = torch.zeros((), device=self.device)
        losses: dict[str, torch.Tensor] = {}
        metrics: dict[str, torch.Tensor] = {}
        with collected_value_checks() as checks:
            for index, batch in enumerate(batches):
                batch.check_token_ids(self.config.model.vocab_size)  # on the host, before the embedding could assert
                batch = self.prepare(batch)

                def micro_step(batch: Batch = batch, last: bool = index == len(batches) - 1) -> LossResult:
                    with gradient_sync(self.train_model, last):
                        with autocast(self.device, self.amp_dtype):
                            result = self.train_model(batch.input_ids, batch.targets(), normalizers, batch.document_ids,
                                                      head=head, padding=batch.padding,
                                                      routed_experts=batch.routed_experts)
                        (result.loss * scale if scale != 1.0 else result.loss).backward()
                    return result

                result = self.compile_fallback.run(micro_step, lambda: self.optimizer.zero_grad(set_to_none=True))
                loss_sum += result.loss.detach().float()
                _accumulate(losses, result.losses)
                _accumulate(metrics, result.metrics)
        tokens = sum(b.input_ids.numel() for b in batches) * self.parallel.dp_size  # every dp rank's rows are alike
        group = self.parallel.dp_group
        return StepResult(sum_over({"loss": loss_sum}, group)["loss"], sum_over(losses, group), sum_over(metrics, group),
                          tokens, checks)

    def optimizer_step(self, result: StepResult) -> None:
        """Clip and apply the update unless the step is bad, decided on the device (no host read): a
        non-finite loss or gradient norm skips it; a failed loss-input check (or, with `trainer.nonfinite:
        stop`, a non-finite step) holds back this update and every later one until the next read point,
        where `settle` raises it, so the weights stay those from before the bad step."""
        max_norm = self.config.optimizer.grad_clip
        fused = fused_update(self.optimizer)  # clips inside its kernel: no pass over the gradients of its own
        result.grad_norm = clip_grad_norm(self.model, None if fused else max_norm, self.parallel)
        result.input_failed = self._input_failed(result.checks)
        nonfinite = ~(torch.isfinite(result.loss) & torch.isfinite(result.grad_norm))
        stop = self.config.trainer.nonfinite == "stop"
        self.halted |= (result.input_failed | nonfinite) if stop else result.input_failed
        divisor = clip_divisor(result.grad_norm, max_norm) if fused and max_norm is not None else None
        step_unless(self.optimizer, self.halted | nonfinite, divisor)
        result.lr = self.scheduler.get_last_lr()[0]
        self.optimizer.zero_grad(set_to_none=True)
        self.pending.add(self.step + 1, result)
        late = self._late_values()  # the last log step's scalars: this step is queued behind them
        if late:
            self._check(late + self.pending.read() if any(values.failed for values in late) else late)
        if self.read_late_at(self.step + 1):
            self.in_flight = self.pending.start_read()
        elif self.read_due(self.step + 1):
            self.settle()
        with warnings.catch_warnings():  # a host-skipped first step trips torch's "scheduler before optimizer" hint
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
            self.scheduler.step()

    def _input_failed(self, checks: list[ValueCheck]) -> torch.Tensor:
        """Device bool: a loss-input check of this step fails, on any rank (all of them then skip the update)."""
        failed = torch.zeros((), dtype=torch.bool, device=self.device)
        for check in checks:
            failed = failed | check.fails()
        if not self.parallel.distributed:
            return failed
        flag = failed.float()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag > 0

    # --- read points ---------------------------------------------------------------------------------
    def logs_at(self, step: int) -> bool:
        return step % self.config.trainer.log_every == 0 or step == self.config.trainer.steps

    def evaluates_at(self, step: int) -> bool:
        every = self.config.trainer.eval_every
        return bool(every) and (step % every == 0 or step == self.config.trainer.steps)

    def checkpoints_at(self, step: int) -> bool:
        every = self.config.trainer.checkpoint_every
        return (bool(every) and step % every == 0) or step == self.config.trainer.steps

    def read_due(self, step: int) -> bool:
        """Whether the scalars are read after `step` (1-based): the loop logs, evaluates or checkpoints then."""
        return self.logs_at(step) or self.evaluates_at(step) or self.checkpoints_at(step)

    def read_late_at(self, step: int) -> bool:
        """Whether `step`'s read point only logs, so its scalars can arrive after the next step is queued (an
        eval or a checkpoint needs the step settled; so does the last step)."""
        return (self.late_reads and self.logs_at(step) and not self.evaluates_at(step)
                and not self.checkpoints_at(step) and step < self.config.trainer.steps)

    def settle(self) -> None:
        """The read point: every pending step's scalars (and a late read's) in one read-back, checked."""
        self._check(self._late_values() + self.pending.read())

    def _late_values(self) -> list[StepValues]:
        """A late read's values (waiting for its transfer), or none; nothing is in flight after."""
        in_flight, self.in_flight = self.in_flight, None
        return in_flight.wait() if in_flight is not None else []

    def _check(self, steps: list[StepValues]) -> None:
        """Raises what was found in `steps`, in step order: a failed loss-input check (the loss's own
        ValueError, naming the step) or a non-finite step under `trainer.nonfinite: stop` (NonFiniteError,
        after a checkpoint of the weights from before it); under `skip_step` counts the skipped steps. The
        values are kept for the log. Steps still unread may have held updates back: only a raise clears that."""
        stop = self.config.trainer.nonfinite == "stop"
        for values in steps:
            values.skipped_steps = self.skipped_steps
            if values.input_failed or (stop and values.nonfinite is not None):
                self.halted.zero_()  # what set it is raised below (a later unread step's flag stays otherwise)
            values.raise_on_bad_input()
            problem = values.nonfinite
            if problem is None:
                continue
            if not stop:
                self.skipped_steps += 1
                values.skipped_steps = self.skipped_steps
                continue
            path = self.save()
            raise NonFiniteError(
                f"non-finite {problem} at step {values.step} (loss {values.loss}, grad_norm {values.grad_norm}); "
                f"weights and optimizer from before this step saved to {path}{_held_back(values.step, steps[-1].step)} "
                "(a resume continues past these batches). "
                "Lower optimizer.lr, enable optimizer.grad_clip, or set trainer.nonfinite: skip_step"
            )
        self.read_values.extend(steps)

    def take_read_values(self) -> list[StepValues]:
        """The steps read since the last call (empty unless a read point has passed)."""
        values, self.read_values = self.read_values, []
        return values

    def train_step(self) -> StepResult:
        self.model.train()
        result = self.forward_backward(self.micro_batches())
        self.optimizer_step(result)
        self.step += 1
        return result

    # --- evaluation, checkpoints ---------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Weighted total loss over the fixed held-out batches (one normaliser over all of them, and all dp ranks)."""
        if not self.eval_set:
            return None
        self.model.eval()
        normalizers = self.step_normalizers(self.eval_set)
        total = torch.zeros((), device=self.device)
        with deferred_value_checks():
            for batch in self.eval_set:
                batch = self.prepare(batch)
                with autocast(self.device, self.amp_dtype):
                    total += self.model(batch.input_ids, batch.targets(), normalizers, batch.document_ids).loss.float()
        return float(sum_over({"loss": total}, self.parallel.dp_group)["loss"])

    def eval_record(self) -> dict[str, float]:
        """What an eval step (`trainer.eval_every`, whatever `log_every` is) logs: the held-out loss, if any."""
        loss = self.evaluate()
        return {} if loss is None else {"eval/loss": loss}

    def state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "scheduler": self.scheduler.state_dict(),
            "data": self.train_loader.state_dict(),
            "data_fingerprint": self.data_fingerprint,
            "rng": rng_state(),
            "wandb_run_id": self.wandb_run_id,
            "total_steps": self.config.trainer.steps,
            "decay_anchor": None if self.decay_anchor is None else self.decay_anchor.to_state(),
            "lora_base": self.lora_base,
        }

    def save(self) -> Path:
        """Distributed: every rank helps gather the full state, rank 0 writes it, all wait for the write.
        Pending steps are read first: a checkpoint never holds the weights of a step that failed."""
        self.settle()
        args = (self.state(), self.config.model_dump(mode="json"), self.config.trainer.keep_checkpoints)
        self.checkpoints_written += 1
        if not self.parallel.distributed:
            path = save_checkpoint(self.checkpoint_dir, self.step, checkpointed(self.model), self.optimizer, *args)
            self._discard_replaced()
            return path
        model_state, optimizer_state = full_state(self.model, self.optimizer, self.parallel)
        model_state = checkpointed(self.model, model_state)
        if self.parallel.rank == 0:
            save_checkpoint(self.checkpoint_dir, self.step, model_state, optimizer_state, *args)
        dist.barrier()
        self._discard_replaced()
        return self.checkpoint_dir / step_dir_name(self.step)

    def _discard_replaced(self) -> None:
        if self.replaced is not None:  # the new run has a checkpoint: the earlier one is not needed back
            self.replaced.discard()
            self.replaced = None

    def resume(self) -> None:
        """Restore model, optimizer, schedule, data position and RNG from the newest checkpoint that
        verifies and fits this run; each one that does not is skipped with the reason."""
        loaded = load_latest_checkpoint(self.checkpoint_dir, use=self._restore)
        self._continue_schedule(loaded)  # once, for the checkpoint restored

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

    def _restore(self, loaded: LoadedCheckpoint) -> None:
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
                self.train_loader.load_state_dict(state["data"])
            except ValueError:
                if same_data:
                    raise
                warnings.warn("the data order starts over: the changed data has another row count", RuntimeWarning, stacklevel=2)
            set_rng_state(state["rng"])
            self.step = int(state["step"])
            self.skipped_steps = int(state["skipped_steps"])
            self.wandb_run_id = state.get("wandb_run_id")
        except CheckpointError:
            raise
        except Exception as error:  # noqa: BLE001 - a malformed piece of a hostile checkpoint: skip it
            raise CheckpointError(f"{loaded.path}: cannot restore it ({type(error).__name__}: {str(error)[:200]})") from None

    def _continue_schedule(self, loaded: LoadedCheckpoint) -> None:
        """A resume with another trainer.steps continues the lr decay from where the checkpoint left it (instead
        of restarting it for the new total), and says so once."""
        state = loaded.trainer_state
        stored = loaded.config.get("trainer") if isinstance(loaded.config.get("trainer"), dict) else {}
        step, total, schedule = self.step, self.config.trainer.steps, self.config.schedule
        try:  # checkpoints from before these keys hold the total in their config
            old_total = int(state.get("total_steps") or stored.get("steps") or total)
            anchor = DecayAnchor.from_state(state.get("decay_anchor"))
        except (TypeError, ValueError, IndexError) as error:
            raise CheckpointError(f"{loaded.path}: its schedule state is malformed ({error})") from None
        self.decay_anchor = anchor_for_resume(step, old_total, total, schedule, anchor)
        if self.decay_anchor is None:
            return
        continue_decay(self.scheduler, total, schedule, self.decay_anchor)
        if old_total != total and self.rank in (None, 0) and step < total:
            end = self.scheduler.lr_lambdas[0](total) * self.scheduler.base_lrs[0]
            print(f"fastlm: trainer.steps is {total}, the checkpoint's run went to {old_total}: the lr decay continues "
                  f"from step {step} (lr {self.scheduler.get_last_lr()[0]:.3g}) to {end:.3g} at step {total} instead "
                  "of restarting", file=sys.stderr, flush=True)

    # --- the loop --------------------------------------------------------------------------------------
    def log_record(self, values: StepValues, tokens_per_second: float) -> dict[str, Any]:
        """The record of a log window ending at `values.step` (its means, see `window_mean`)."""
        record: dict[str, Any] = {
            "train/loss": values.loss,
            **{f"train/loss/{name}": value for name, value in values.losses.items()},
            **{f"train/{name}": value for name, value in values.metrics.items()},
            "train/lr": values.lr,
            "train/grad_norm": values.grad_norm,
            "train/tokens_per_second": tokens_per_second,
            "train/step": float(values.step),
        }
        if self.config.trainer.nonfinite == "skip_step":
            record["train/skipped_steps"] = float(values.skipped_steps)
        return record

    def _run_config(self) -> dict[str, Any]:
        described = describe_head(self.config, self.device)  # the path dispatch picks on this device, and the head
        return {**self.config.model_dump(mode="json"), "loss_implementation": described}

    def _any_rank(self, flag: bool) -> bool:
        """True on every rank if it is true on any (ranks must agree before a collective step)."""
        if not self.parallel.distributed:
            return flag
        value = torch.tensor(float(flag), device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value)

    def _stop_requested(self, stop: StopRequest) -> bool:
        """Every rank stops at the same step (the checkpoint gathers from all of them), if any rank was signalled."""
        return self._any_rank(stop.requested)

    def _claim_run_dir(self) -> None:
        """A fresh run never mixes with an earlier run's checkpoints or metrics: refuse such a directory,
        or clear them first with `run.overwrite: true` (rank 0 holds the lock, looks and clears)."""
        earlier = earlier_run(self.run_dir) if self.rank in (None, 0) else []
        if self._any_rank(bool(earlier) and not self.config.run.overwrite):
            raise RunDirError(f"run directory {self.run_dir} already holds an earlier run "
                              f"({', '.join(earlier) or 'see rank 0'}); {EARLIER_RUN_FIX}")
        if earlier:  # set aside, not deleted, until this run's first checkpoint (fastlm/system/run_dir.py)
            self.replaced = ReplacedRun.set_aside(self.run_dir, [CHECKPOINT_DIR, METRICS_FILE])

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
                    return self._summary([], None, 0, 0.0, None, already_finished=True)
                if self.rank in (None, 0) and self.config.logging.jsonl:  # steps past the checkpoint are re-run
                    drop_records_after(self.run_dir / METRICS_FILE, self.step)
            else:
                self._claim_run_dir()
                if lock is not None:
                    fresh = FreshStart(self.run_dir, self.checkpoint_dir, existed, lock)
            if lock is not None:  # a full disk is found now, not after the steps up to the next checkpoint
                ensure_space(self.run_dir, 3 * checkpoint_bytes(self.model), "the next checkpoint (weights + AdamW)",
                             "the previous checkpoint is intact" if resume else "")
            return self._train_loop()
        except BaseException:
            if fresh is not None and self.step == 0 and not self.checkpoints_written:
                fresh.undo()
            else:
                fresh = None
            if self.replaced is not None:  # failed before its first checkpoint: the earlier run goes back
                self.replaced.restore()
                self.replaced = None
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
        trainer = self.config.trainer
        stopped_by = None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        losses: list[float] = []
        eval_loss = None
        total_tokens, total_seconds = 0, 0.0
        window_tokens, window_seconds = 0, 0.0
        window: list[StepValues] = []  # the steps read since the last log record
        if self.rank in (None, 0) and self.config.logging.progress:
            print(self.banner(), file=sys.stderr, flush=True)
        with StopRequest() as stop, MetricLogger(
            self.config.logging, self.run_dir, self.config.run.name, trainer.steps, self._run_config(), self.rank,
            self.wandb_run_id, start_step=self.step,
        ) as logger:
            if logger.wandb is not None and logger.wandb.run_id is not None:
                self.wandb_run_id = logger.wandb.run_id
            clock = time.perf_counter()
            while self.step < trainer.steps:
                self.train_step()
                stopping = self._stop_requested(stop)
                if stopping:
                    self.settle()  # everything read now (a late read too), so every record is logged
                read = self.take_read_values()  # empty unless this step was a read point (or the last one's, late)
                if read:
                    seconds, tokens = time.perf_counter() - clock, sum(values.tokens for values in read)
                    total_tokens, total_seconds = total_tokens + tokens, total_seconds + seconds
                    window_tokens, window_seconds = window_tokens + tokens, window_seconds + seconds
                    losses.extend(values.loss for values in read)
                records: dict[int, dict[str, Any]] = {}  # a late read logs the step before this one
                for values in read:
                    window.append(values)
                    if self.logs_at(values.step):
                        records[values.step] = self.log_record(window_mean(window),
                                                               window_tokens / max(window_seconds, 1e-9))
                        window = []
                if read and self.logs_at(read[-1].step):
                    window_tokens, window_seconds = 0, 0.0
                if self.evaluates_at(self.step):
                    scores = self.eval_record()
                    eval_loss = scores.get("eval/loss")
                    if scores:
                        records.setdefault(self.step, {}).update(scores)
                for step, record in sorted(records.items()):
                    logger.log(step, record)
                if self.checkpoints_at(self.step) or stopping:
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
        return self._summary(losses, eval_loss, total_tokens, total_seconds, stopped_by)

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

    def _summary(self, losses: list[float], eval_loss: float | None, tokens: int, seconds: float,
                 stopped_by: str | None, already_finished: bool = False) -> TrainSummary:
        return TrainSummary(
            steps=self.step,
            first_loss=losses[0] if losses else None,
            last_loss=losses[-1] if losses else None,
            tokens_per_second=tokens / max(seconds, 1e-9),
            skipped_steps=self.skipped_steps,
            eval_loss=eval_loss,
            run_dir=self.run_dir,
            losses=losses,
            stopped_by=stopped_by,
            already_finished=already_finished,
        )
