"""One optimizer step and its read points: micro-batches -> gradients against step-wide normalizers -> an update
decided on the device -> the scalars read back only at read points.

The host never waits for the GPU inside a step: the step's scalars stay on the device and its checks decide
on the device (fastlm/engine/step_scalars.py). They are read back in one transfer at the next read point (a
step that logs, evaluates or checkpoints, and the last), which raises what was found. A read point that only
logs is read late: the host queues the next step before it waits for the transfer.

Data parallel: each rank's loss is its share of the global mean; DDP/FSDP average gradients over dp, so the
backward is scaled by dp to make the reduced gradient the global sum. This is the code that runs in every step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from fastlm.data.batch import Batch
from fastlm.engine.compile import CompileFallback
from fastlm.engine.distributed import Parallel, clip_grad_norm, gradient_sync, sum_over
from fastlm.engine.optim import clip_divisor, fused_update, step_unless
from fastlm.engine.step_scalars import InFlightRead, PendingSteps, StepResult, StepValues
from fastlm.layers.lm_head import LMHead
from fastlm.losses.spec import LossNormalizers, LossResult
from fastlm.losses.validation import ValueCheck, collected_value_checks
from fastlm.system.device import autocast

if TYPE_CHECKING:
    from fastlm.run_config.schema import RunConfig


class NonFiniteError(RuntimeError):
    """Training met a non-finite loss or gradient with `trainer.nonfinite: stop`."""


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


def global_normalizers(batches: list[Batch], parallel: Parallel, device: torch.device) -> LossNormalizers:
    """`step_normalizers` of this rank's batches, summed over the data-parallel ranks."""
    local = step_normalizers(batches)
    if parallel.dp_group is None:
        return local
    counts = {name: torch.tensor(getattr(local, name)) for name in ("tokens", "documents", "micro_batches", "positions")}
    summed = sum_over({k: v.to(device) for k, v in counts.items()}, parallel.dp_group)
    return LossNormalizers(**{name: float(value) for name, value in summed.items()})


def _accumulate(total: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> None:
    for name, value in values.items():
        total[name] = total[name] + value.detach() if name in total else value.detach()


def _held_back(failed: int, last: int) -> str:
    """The steps after a failed one that ran before the read point found it, their updates held back."""
    if last == failed:
        return ""
    return f"; step {last} made no update" if last == failed + 1 else f"; steps {failed + 1}-{last} made no update"


class StepRunner:
    """Gradients, the update and the read points of every step; `save` writes a checkpoint (a non-finite step
    under `trainer.nonfinite: stop` saves the weights from before it)."""

    def __init__(self, config: RunConfig, model: torch.nn.Module, train_model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, parallel: Parallel,
                 device: torch.device, amp_dtype: torch.dtype | None, late_reads: bool, verbose: bool,
                 save: Callable[[], Path]):
        self.config, self.model, self.train_model = config, model, train_model
        self.optimizer, self.scheduler, self.parallel = optimizer, scheduler, parallel
        self.device, self.amp_dtype, self.save = device, amp_dtype, save
        self.compile_fallback = CompileFallback(model, verbose=verbose)
        # On CPU the host runs the step itself: there is no queue to keep fed, so every read is on time.
        self.late_reads = late_reads and device.type == "cuda"
        self.skipped_steps = 0
        self.pending = PendingSteps()  # steps whose scalars are not read yet
        self.in_flight: InFlightRead | None = None  # a log-only read point's transfer, waited for a step later
        self.read_values: list[StepValues] = []  # read by the last read point, for the loop to log
        self.halted = torch.zeros((), dtype=torch.bool, device=device)  # a failure holds every update back

    def forward_backward(self, batches: list[Batch], head: LMHead, prepare: Callable[[Batch], Batch]) -> StepResult:
        """Backward every micro-batch (`prepare`d just before its forward) through `head` against step-wide
        normalizers, so gradients add up to one big batch. Nothing is read back: the loss-input checks are
        collected for the next read point."""
        normalizers = global_normalizers(batches, self.parallel, self.device)
        if normalizers.tokens == 0:
            raise ValueError("this step's micro-batches have no unmasked labels; check the data (all prompt?)")
        scale = float(self.parallel.dp_size)
        loss_sum = torch.zeros((), device=self.device)
        losses: dict[str, torch.Tensor] = {}
        metrics: dict[str, torch.Tensor] = {}
        with collected_value_checks() as checks:
            for index, batch in enumerate(batches):
                batch.check_token_ids(self.config.model.vocab_size)  # on the host, before the embedding could assert
                batch = prepare(batch)

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

    def optimizer_step(self, result: StepResult, step: int) -> None:
        """Clip and apply the update of step `step` (1-based) unless the step is bad, decided on the device (no
        host read): a non-finite loss or gradient norm skips it; a failed loss-input check (or, with
        `trainer.nonfinite: stop`, a non-finite step) holds back this update and every later one until the next
        read point, where `settle` raises it, so the weights stay those from before the bad step."""
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
        self.pending.add(step, result)
        late = self._late_values()  # the last log step's scalars: this step is queued behind them
        if late:
            self._check(late + self.pending.read() if any(values.failed for values in late) else late)
        if self.read_late_at(step):
            self.in_flight = self.pending.start_read()
        elif self.read_due(step):
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
