"""The local record of a run: `metrics.jsonl`, one JSON object per log call, flushed per line."""

from __future__ import annotations

import json
import math
import os
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

    def log(self, step: int, metrics: dict[str, float | list[dict]]) -> None:
        """A list value (a table's rows) is written as it is; scalar readers skip it."""
        values = {k: v if isinstance(v, list) else _plain(float(v)) for k, v in metrics.items()}
        record = {"step": step, "time": time.time(), **values}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def drop_records_after(path: Path, step: int) -> int:
    """Keep the records up to `step` (a resume re-runs the later ones) and a torn last line; returns how many went.

    A process killed after its last checkpoint has logged steps that the resumed run logs again; without
    this, the file would hold two records for those steps. Rewritten atomically (temp file + rename).
    """
    if not path.is_file():
        return 0
    kept: list[str] = []
    dropped = 0
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        if not line.endswith("\n"):  # torn by a kill mid-write: not a record
            dropped += 1
            continue
        if line.strip() and json.loads(line).get("step", 0) > step:
            dropped += 1
            continue
        kept.append(line)
    if dropped:
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_text("".join(kept), encoding="utf-8")
        os.replace(temporary, path)
    return dropped


def read_metrics(path: Path) -> list[dict]:
    """Every record of a metrics.jsonl, in order (what plots and tests read back)."""
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
