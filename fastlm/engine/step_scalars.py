"""A training step's scalars stay on the device; the loop reads them back at read points only.

Reading a scalar (`float(t)`, `.item()`, `.tolist()`) makes the host wait until the GPU has run all it
was given, and then the GPU waits while the host prepares the next step: a bubble at every read. So a
step keeps its loss, per-loss values, metrics, gradient norm and loss-input checks as device tensors
(`StepResult`), and what it decides from them is decided on the device: the update of a non-finite step
or of a step whose loss inputs fail a check is skipped there (`fastlm.engine.optim.step_unless`).
`PendingSteps` holds the steps since the last read; `read()` fetches all of their scalars in one
transfer at the next read point (a log, eval or checkpoint step, or the last one), where the trainer
raises what was found in between. At a read point that only logs, the transfer starts behind the step
(`start_read`) and the host waits for it (`InFlightRead.wait`) only after it has queued the next step, so
the GPU is never left waiting for the host there.

A log record stands for its logging window (every step since the last record), as in other trainers: its loss,
per-loss values and metrics are the window's means (`window_mean`), taken on the host from the values the
read points brought back anyway (no extra read).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fastlm.losses.validation import ValueCheck, check_counts, raise_on_first_bad


@dataclass
class StepResult:
    """One optimizer step, summed over its micro-batches (each LossResult is already its share of the
    mean). Tensors stay on the device; `tokens` is a host count."""

    loss: torch.Tensor
    losses: dict[str, torch.Tensor]
    metrics: dict[str, torch.Tensor]
    tokens: int  # input tokens processed, over every data-parallel rank (throughput)
    checks: list[ValueCheck] = field(default_factory=list)  # the loss calls' input checks, unread
    grad_norm: torch.Tensor | None = None  # set by the optimizer step
    input_failed: torch.Tensor | None = None  # device bool: an input check fails (on any rank); set likewise
    lr: float = float("nan")  # the learning rate this step's update used; set likewise


@dataclass
class StepValues:
    """A step's scalars on the host, as read at a read point."""

    step: int
    loss: float
    losses: dict[str, float]
    metrics: dict[str, float]
    tokens: int
    grad_norm: float
    input_failed: bool
    checks: list[ValueCheck]
    counts: list[float]  # the checks' counts, flat
    lr: float
    skipped_steps: int = 0  # non-finite steps skipped up to and including this one (set when read)

    @property
    def nonfinite(self) -> str | None:
        """What is not finite ('loss' or 'gradient norm'), or None."""
        if not math.isfinite(self.loss):
            return "loss"
        return None if math.isfinite(self.grad_norm) else "gradient norm"

    @property
    def failed(self) -> bool:
        """An input check failed or a value is not finite: the read point has something to raise or count."""
        return self.input_failed or self.nonfinite is not None

    def raise_on_bad_input(self) -> None:
        """The loss's own ValueError for this step's first failed input check, naming the step; a check that
        failed on another data-parallel rank only (its own error names the tensor there) is named as such."""
        try:
            raise_on_first_bad(self.checks, self.counts)
        except ValueError as error:
            raise ValueError(f"step {self.step}: {error}") from None
        if self.input_failed:
            raise ValueError(f"step {self.step}: a loss input check failed on another rank (its error names the tensor)")


def _mean(values: list[float]) -> float:
    """The mean of the finite values (a skipped non-finite step counts in no mean); NaN when there are none."""
    finite = [value for value in values if math.isfinite(value)]
    return sum(finite) / len(finite) if finite else math.nan


def window_mean(window: list[StepValues]) -> StepValues:
    """The steps of one logging window as one record: loss, per-loss values and metrics averaged over the window,
    the rest (step, lr, gradient norm, counters, checks) the last step's."""
    last = window[-1]
    return StepValues(
        last.step, _mean([v.loss for v in window]),
        {name: _mean([v.losses[name] for v in window if name in v.losses]) for name in last.losses},
        {name: _mean([v.metrics[name] for v in window if name in v.metrics]) for name in last.metrics},
        last.tokens, last.grad_norm, last.input_failed, last.checks, last.counts, last.lr, last.skipped_steps,
    )


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).float()


class PendingSteps:
    """The steps run since the last read, their scalars unread."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, StepResult]] = []

    def __len__(self) -> int:
        return len(self.steps)

    def add(self, step: int, result: StepResult) -> None:
        if result.grad_norm is None or result.input_failed is None:
            raise ValueError("a pending step needs its grad_norm and input_failed (set by the optimizer step)")
        self.steps.append((step, result))

    def read(self) -> list[StepValues]:
        """Every pending step's scalars in one device->host transfer, in step order; nothing is pending after."""
        return self.start_read().wait()

    def start_read(self) -> InFlightRead:
        """Start the one transfer without waiting for it (a copy into pinned memory behind the queued work);
        nothing is pending after. `wait()` on the result later: the host can queue the next step first."""
        steps, self.steps = self.steps, []
        parts = []
        for _, result in steps:
            parts += [_flat(result.loss), _flat(result.grad_norm), _flat(result.input_failed)]
            parts += [_flat(value) for value in (*result.losses.values(), *result.metrics.values())]
            parts += check_counts(result.checks)
        return InFlightRead(steps, torch.cat(parts) if parts else None)


class InFlightRead:
    """The scalars of some steps on their way to the host."""

    def __init__(self, steps: list[tuple[int, StepResult]], flat: torch.Tensor | None) -> None:
        self.steps = steps
        self.done: torch.cuda.Event | None = None
        self.host = flat
        if flat is not None and flat.is_cuda:
            self.host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self.host.copy_(flat, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()

    def wait(self) -> list[StepValues]:
        """The steps' values, in step order (waits for the GPU to finish them)."""
        if self.host is None:
            return []
        if self.done is not None:
            self.done.synchronize()
        values = iter(self.host.tolist())
        read = []
        for step, result in self.steps:
            loss, grad_norm, input_failed = next(values), next(values), next(values)
            losses = {name: next(values) for name in result.losses}
            metrics = {name: next(values) for name in result.metrics}
            counts = [next(values) for check in result.checks for _ in range(check.counts.numel())]
            read.append(StepValues(step, loss, losses, metrics, result.tokens, grad_norm, bool(input_failed),
                                   result.checks, counts, result.lr))
        return read
