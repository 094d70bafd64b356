"""A one-line human view of training on stderr: redrawn in place on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
from typing import TextIO


class ProgressLine:
    """Shows step/total, loss, eval loss, RL rewards (train/reward, greedy eval/reward), lr and tokens/s,
    each when the log call carries it."""

    def __init__(self, total_steps: int, stream: TextIO | None = None):
        self.total_steps = total_steps
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._width = 0

    def log(self, step: int, metrics: dict[str, float]) -> None:
        parts = [f"step {step}/{self.total_steps}"]
        for key, label, fmt in (
            ("train/loss", "loss", ".4f"),
            ("eval/loss", "eval", ".4f"),
            ("train/reward", "reward", ".3f"),
            ("eval/reward", "eval reward", ".3f"),
            ("train/lr", "lr", ".2e"),
            ("train/tokens_per_second", "tok/s", ".0f"),
        ):
            if key in metrics:
                parts.append(f"{label} {format(float(metrics[key]), fmt)}")
        if len(parts) == 1:
            return
        line = " | ".join(parts)
        if self.tty:
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
