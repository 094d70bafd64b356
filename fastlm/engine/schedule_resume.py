"""A resume whose `trainer.steps` differs from the checkpoint's run: the lr decay goes on from where it was.

A schedule built for the new total alone would restart the decay (a cosine at step 150 of 300 sits far above
where it was at step 150 of 200: the lr jumps up). Instead the decay is anchored at the last step trained:
from there its progress runs linearly from the value it had to 1 at the new end, so the lr goes on down
from where it was and reaches `min_lr_ratio` x peak at the last step. The anchor is kept in each checkpoint, so a later resume
(with the same or yet another total) continues the same curve.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.optim.lr_scheduler import LambdaLR

from fastlm.engine.config import ScheduleConfig
from fastlm.engine.optim import decay_multiplier, lr_multiplier


@dataclass(frozen=True)
class DecayAnchor:
    """The step where the decay was re-anchored and its progress (0..1) there."""

    step: int
    progress: float

    def to_state(self) -> list[float]:
        return [self.step, self.progress]

    @classmethod
    def from_state(cls, value: Any) -> DecayAnchor | None:
        return None if value is None else cls(int(value[0]), float(value[1]))


def decay_progress(step: float, total_steps: int, config: ScheduleConfig, anchor: DecayAnchor | None) -> float:
    """How far through the decay `step` is: from the warm-up's end (or the anchor) to `total_steps`."""
    start, begun = (anchor.step, anchor.progress) if anchor is not None else (config.warmup_steps, 0.0)
    return min(1.0, begun + (1.0 - begun) * max(0.0, step - start) / max(1, total_steps - start))


def anchor_for_resume(step: int, old_total: int, new_total: int, config: ScheduleConfig,
                      anchor: DecayAnchor | None) -> DecayAnchor | None:
    """The anchor a resume at `step` needs: the run's own with the same total; none while the warm-up has not
    ended (the decay for the new total is the one the run was on); else one at the last step trained, whose
    progress the decay goes on from (a finished run's schedule already sits at its end one step later)."""
    if old_total == new_total:
        return anchor
    last = step - 1
    if last < config.warmup_steps:
        return None
    return DecayAnchor(last, decay_progress(last, old_total, config, anchor))


def continue_decay(scheduler: LambdaLR, total_steps: int, config: ScheduleConfig, anchor: DecayAnchor) -> None:
    """From the anchor's step on, each of the scheduler's multipliers (the run's schedule, times any factor of
    its own such as RL's lr_scale) has its decay replaced by the anchored one."""

    def anchored(original: Callable[[int], float]) -> Callable[[int], float]:
        def multiplier(step: int) -> float:
            plain = lr_multiplier(step, total_steps, config)
            if step < anchor.step or plain <= 0.0:
                return original(step)
            return original(step) / plain * decay_multiplier(decay_progress(step, total_steps, config, anchor), config)

        return multiplier

    scheduler.lr_lambdas = [anchored(function) for function in scheduler.lr_lambdas]
    # The next step's lr was set by the old schedule (and restored with the optimizer): set the anchored one.
    lrs = [base * function(scheduler.last_epoch) for base, function in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports
