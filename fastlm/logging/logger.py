"""`MetricLogger`: one call fans a step's scalars out to JSONL, wandb and the progress line (rank 0 only)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from fastlm.logging.config import LoggingConfig
from fastlm.logging.jsonl import JsonlSink
from fastlm.logging.progress import ProgressLine
from fastlm.logging.wandb_sink import WandbSink

METRICS_FILE = "metrics.jsonl"


Rows = list[dict[str, Any]]  # a table value: one dict per row, the same keys in each (e.g. sample completions)


class Sink(Protocol):
    def log(self, step: int, metrics: dict[str, float | Rows]) -> None: ...

    def close(self) -> None: ...


class MetricLogger:
    """Only rank 0 writes; other ranks get a logger with no sinks, so call sites need no rank checks.

    `run_config` (the resolved config plus facts such as the loss implementation) goes to wandb once;
    `wandb_run_id` continues an earlier wandb run (a resume), whose first step is `start_step` (the progress
    line's pace counts from there).
    """

    def __init__(
        self,
        config: LoggingConfig,
        run_dir: Path | str,
        run_name: str,
        total_steps: int,
        run_config: dict[str, Any] | None = None,
        rank: int | None = None,
        wandb_run_id: str | None = None,
        start_step: int = 0,
    ):
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.run_dir = Path(run_dir)
        self.sinks: list[Sink] = []
        self.wandb: WandbSink | None = None
        if self.rank != 0:
            return
        if config.jsonl:
            self.sinks.append(JsonlSink(self.run_dir / METRICS_FILE))
        if config.wandb.enabled and config.wandb.mode != "disabled":
            self.wandb = WandbSink(config.wandb, self.run_dir, run_name, run_config or {}, wandb_run_id)
            self.sinks.append(self.wandb)
        if config.progress:
            self.sinks.append(ProgressLine(total_steps, timing=True, start_step=start_step))

    def log(self, step: int, metrics: dict[str, float | Rows]) -> None:
        """A list value is a table (rows of dicts): JSONL keeps it in the step's record, wandb as a `wandb.Table`."""
        if not metrics:
            return
        plain = {key: value if isinstance(value, list) else float(value) for key, value in metrics.items()}
        for sink in self.sinks:
            sink.log(step, plain)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> MetricLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
