"""The local record of a run: `metrics.jsonl`, one JSON object per log call, flushed per line."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path


def _plain(value: float) -> float | None:
    """JSON has no NaN/inf: non-finite values are written as null so every line stays strict JSON."""
    return value if math.isfinite(value) else None


class JsonlSink:
    """Appends {"step": n, "time": t, key: value, ...}; append mode so a resumed run continues the file."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(), **{k: _plain(float(v)) for k, v in metrics.items()}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: Path) -> list[dict]:
    """Every record of a metrics.jsonl, in order (what plots and tests read back)."""
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
