"""Throughput and the log windows: what the loop measures between read points and what a record says of them.

Throughput is tokens over wall time between read points (the GPU has finished the steps read there). A log
record stands for its logging window (every step since the last record), as in other trainers: its loss,
per-loss values and metrics are the window's means (`window_mean`), taken on the host from the values the
read points brought back anyway (no extra read).
"""

from __future__ import annotations

from typing import Any

from fastlm.engine.step_scalars import StepValues, window_mean


class Meter:
    """Totals over the run and the current log window's steps, tokens and seconds."""

    def __init__(self) -> None:
        self.losses: list[float] = []  # train/loss of every step read
        self.total_tokens, self.total_seconds = 0, 0.0
        self.window_tokens, self.window_seconds = 0, 0.0
        self.window: list[StepValues] = []  # the steps read since the last record

    def read(self, steps: list[StepValues], seconds: float) -> None:
        """The steps one read point brought back, and the wall seconds since the previous one."""
        tokens = sum(values.tokens for values in steps)
        self.total_tokens, self.total_seconds = self.total_tokens + tokens, self.total_seconds + seconds
        self.window_tokens, self.window_seconds = self.window_tokens + tokens, self.window_seconds + seconds
        self.losses.extend(values.loss for values in steps)

    def append(self, values: StepValues) -> None:
        self.window.append(values)

    def record(self, skipped_steps: bool) -> dict[str, Any]:
        """The record of the window so far (its means and tokens/s), which starts a new window of steps."""
        values = window_mean(self.window)
        self.window = []
        record: dict[str, Any] = {
            "train/loss": values.loss,
            **{f"train/loss/{name}": value for name, value in values.losses.items()},
            **{f"train/{name}": value for name, value in values.metrics.items()},
            "train/lr": values.lr,
            "train/grad_norm": values.grad_norm,
            "train/tokens_per_second": self.window_tokens / max(self.window_seconds, 1e-9),
            "train/step": float(values.step),
        }
        if skipped_steps:
            record["train/skipped_steps"] = float(values.skipped_steps)
        return record

    def reset_window_time(self) -> None:
        """After a read point that logged: the next window's throughput starts from zero."""
        self.window_tokens, self.window_seconds = 0, 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.total_tokens / max(self.total_seconds, 1e-9)
