"""Test helper: read an offline wandb run file (`run-*.wandb`) back without syncing: history rows and config.

The file is wandb's transaction log (wandb 0.31 ships no public reader): a 7-byte header
(":W&B", magic, version), then 32 KiB blocks of [crc32 (4) | length (2) | type (1) | payload] chunks,
where type 1 is a whole record and 2/3/4 are the first/middle/last pieces of a split one.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

from wandb.proto import wandb_internal_pb2

_BLOCK = 32 * 1024
_CHUNK_HEADER = 7


def _payloads(raw: bytes) -> list[bytes]:
    if raw[:4] != b":W&B":
        raise ValueError("not a wandb run file (bad header)")
    records, pending, position = [], b"", 7
    while position + _CHUNK_HEADER <= len(raw):
        left = _BLOCK - position % _BLOCK
        if left < _CHUNK_HEADER:
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[position : position + _CHUNK_HEADER])
        if kind == 0:  # zero padding up to the block end
            position += left
            continue
        payload = raw[position + _CHUNK_HEADER : position + _CHUNK_HEADER + length]
        position += _CHUNK_HEADER + length
        if kind == 1:
            records.append(payload)
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        else:
            records.append(pending + payload)
    return records


def _records(path: Path, timeout_s: float) -> list[wandb_internal_pb2.Record]:
    """Every record, waiting (up to `timeout_s`) for the exit record: wandb's service process may still be
    writing the file for a moment after `run.finish()` returns."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = []
        for payload in _payloads(path.read_bytes()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            records.append(record)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def read_wandb_run(path: Path, timeout_s: float = 10.0) -> tuple[list[dict[str, float]], dict[str, object]]:
    """(history rows without wandb's own `_` keys, the run's config) of one offline run file."""
    history, config = [], {}
    for record in _records(path, timeout_s):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            history.append({k: v for k, v in row.items() if not k.startswith("_")} | {"step": row["_step"]})
        elif kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            for item in updates:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return history, config
