"""Driving one trainer step by hand in tests: gradients of given micro-batches through the objective's head."""

from __future__ import annotations

from fastlm.data.batch import Batch
from fastlm.engine.step_scalars import StepResult
from fastlm.engine.trainer import Trainer


def forward_backward(trainer: Trainer, batches: list[Batch]) -> StepResult:
    """What `Trainer.train_step` does with `batches` before the update."""
    return trainer.runner.forward_backward(batches, trainer.objective.head(trainer.step), trainer.objective.prepare)


def next_batches(trainer: Trainer) -> list[Batch]:
    """The micro-batches of the trainer's next step."""
    return trainer.objective.batches(trainer.step)
