"""The local record of a run: `metrics.jsonl`, one JSON object per log call, flushed per line.

The file is opened with `open_run_file` (never through a symbolic link, only a regular file), so a link
planted in the run directory cannot make the run append its records elsewhere."""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any

from fastlm.system.disk_space import raise_if_disk_full
from fastlm.system.run_dir import open_run_file


def plain_json(value: Any) -> Any:
    """`value` with every non-finite float, at any depth of its lists and dicts (a table's rows), as None:
    JSON has no NaN/inf, so they are written as null and every line stays strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (list, tuple)):
        return [plain_json(item) for item in value]
    if isinstance(value, dict):
        return {key: plain_json(item) for key, item in value.items()}
    return value


class JsonlSink:
    """Appends {"step": n, "time": t, key: value, ...}; append mode so a resumed run continues the file."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        fd = open_run_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        self._file = os.fdopen(fd, "a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, float | list[dict]]) -> None:
        """A list value (a table's rows) is written as rows; scalar readers skip it."""
        values = {k: plain_json(v if isinstance(v, list) else float(v)) for k, v in metrics.items()}
        record = {"step": step, "time": time.time(), **values}
        line = json.dumps(record, allow_nan=False) + "\n"
        try:
            self._file.write(line)
            self._file.flush()
        except OSError as error:  # a torn last line is dropped by the next --resume
            raise_if_disk_full(error, f"the step {step} record of {self.path.name}", self.path.parent, len(line),
                               "the checkpoints are intact", then="continue with --resume")
            raise

    def close(self) -> None:
        self._file.close()


def _record_step(line: bytes) -> int | None:
    """The step of one whole JSONL record; None when the line is damaged (torn, not UTF-8, not a record)."""
    if not line.endswith(b"\n"):
        return None
    try:
        record = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if type(step) is int else None


def drop_records_after(path: Path, step: int) -> int:
    """Keep the records up to `step` (a resume re-runs the later ones); returns how many lines went.

    A process killed after its last checkpoint has logged steps that the resumed run logs again; without
    this, the file would hold two records for those steps. A damaged line (torn by a kill mid-write, or
    corrupted) is dropped with a warning naming it. Streams line by line and rewrites atomically (temp
    file + rename), so memory stays bounded and a kill here loses nothing.
    """
    if not os.path.lexists(path):
        return 0
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.unlink(missing_ok=True)
    try:
        dropped, damaged = _copy_records(path, temporary, step)
        if dropped:
            os.replace(temporary, path)
    except OSError as error:
        raise_if_disk_full(error, f"a repaired copy of {path.name}", path.parent, path.stat().st_size,
                           f"{path.name} itself is unchanged", then="resume again")
        raise
    finally:
        temporary.unlink(missing_ok=True)
    if damaged:
        shown = ", ".join(map(str, damaged[:5])) + (" ..." if len(damaged) > 5 else "")
        warnings.warn(f"{path}: dropped {len(damaged)} damaged line(s) (line {shown}); the records up to step "
                      f"{step} are kept", RuntimeWarning, stacklevel=2)
    return dropped


def _copy_records(path: Path, target_path: Path, step: int) -> tuple[int, list[int]]:
    """Copy the whole records up to `step` into `target_path`, fsynced; (lines dropped, damaged line numbers)."""
    dropped, damaged = 0, []
    with os.fdopen(open_run_file(path, os.O_RDONLY), "rb") as source, \
            os.fdopen(open_run_file(target_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as target:
        for number, line in enumerate(source, start=1):
            if not line.strip():
                continue
            found = _record_step(line)
            if found is None:
                damaged.append(number)
            if found is None or found > step:
                dropped += 1
                continue
            target.write(line)
        target.flush()
        os.fsync(target.fileno())
    return dropped, damaged


def read_metrics(path: Path) -> list[dict]:
    """Every record of a metrics.jsonl, in order (what plots and tests read back)."""
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
