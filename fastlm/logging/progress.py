"""A one-line human view of training on stderr: redrawn in place on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


def clock_text(seconds: float) -> str:
    """h:mm:ss, or m:ss under an hour."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class ProgressLine:
    """Shows step/total, loss (the logging window's mean), eval loss, RL rewards (train/reward, greedy
    eval/reward), lr and tokens/s, each when the log call carries it; with `timing`, the time since the start
    and the estimated time left (from this process's pace since `start_step`, a resume's first step)."""

    def __init__(self, total_steps: int, stream: TextIO | None = None, timing: bool = False, start_step: int = 0,
                 clock: Callable[[], float] = time.monotonic):
        self.total_steps = total_steps
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._width = 0
        self.timing = timing
        self.start_step = start_step
        self.clock = clock
        self.started = clock()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        parts = [f"step {step}/{self.total_steps}"]
        for key, label, fmt in (
            ("train/loss", "loss", ".4f"),
            ("eval/loss", "eval", ".4f"),
            ("train/reward", "reward", ".3f"),
            ("eval/reward", "eval reward", ".3f"),
            ("train/lr", "lr", ".2e"),
            ("train/tokens_per_second", "tok/s", ",.0f"),
        ):
            if key in metrics:
                parts.append(f"{label} {format(float(metrics[key]), fmt)}")
        if len(parts) == 1:
            return
        if self.timing:
            parts.append(self._times(step))
        line = " | ".join(parts)
        if self.tty:
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def _times(self, step: int) -> str:
        elapsed = self.clock() - self.started
        done = step - self.start_step
        left = elapsed / done * (self.total_steps - step) if done > 0 else None
        return f"{clock_text(elapsed)} elapsed, ETA " + (clock_text(left) if left is not None else "?")

    def close(self) -> None:
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
