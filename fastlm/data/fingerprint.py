"""What a run trained on, recorded in every checkpoint, so a resume on changed data is caught.

A source's fingerprint is its config (generated corpora are fully described by it) plus, for every
file it reads, the resolved path, size, modification time and a sha256 of the content: the whole file
up to `FULL_HASH_BYTES`, beyond that `SAMPLES` evenly spaced blocks (bounded cost on a 100 GB memmap),
where the modification time stands in for the unsampled bytes.

Sources name their files through `data_files()` when they have one (several files, a memmap prefix),
else every `path` / `*_path` string field is a file. `fingerprint_files` is the building block for
anything else that reads files (e.g. `fastlm prepare`'s outputs).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

FULL_HASH_BYTES = 64 << 20
SAMPLES = 64
SAMPLE_BYTES = 1 << 20


def _content_sha256(path: Path, size: int) -> tuple[str, bool]:
    """(hex digest, whether the whole file was hashed)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        if size <= FULL_HASH_BYTES:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
            return digest.hexdigest(), True
        stride = (size - SAMPLE_BYTES) // (SAMPLES - 1)
        for index in range(SAMPLES):
            handle.seek(index * stride)
            digest.update(handle.read(SAMPLE_BYTES))
    return digest.hexdigest(), False


def fingerprint_files(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """One record per file: path (resolved), size, mtime_ns, sha256, and whether the hash is complete."""
    records = []
    for path in paths:
        resolved = Path(path).resolve()
        info = os.stat(resolved)
        sha256, complete = _content_sha256(resolved, info.st_size)
        records.append({"path": str(resolved), "size": info.st_size, "mtime_ns": info.st_mtime_ns,
                        "sha256": sha256, "complete": complete})
    return records


def source_files(source: BaseModel) -> list[Path]:
    """The files a data source reads: its `data_files()`, else its `path` / `*_path` string fields."""
    own = getattr(source, "data_files", None)
    if callable(own):
        return [Path(path) for path in own()]
    return [Path(value) for name, value in source if isinstance(value, str) and (name == "path" or name.endswith("_path"))]


def data_fingerprint(source: BaseModel) -> dict[str, Any]:
    """The source's config and the fingerprint of every file it reads."""
    return {"source": source.model_dump(mode="json"), "files": fingerprint_files(source_files(source))}


def describe_change(stored: dict[str, Any], current: dict[str, Any]) -> str | None:
    """What differs between a checkpoint's fingerprint and today's data, in words; None if nothing does."""
    if stored.get("source") != current.get("source"):
        before, now = stored.get("source") or {}, current.get("source") or {}
        keys = sorted(key for key in set(before) | set(now) if before.get(key) != now.get(key))
        return "data.source changed: " + ", ".join(f"{key} {before.get(key)!r} -> {now.get(key)!r}" for key in keys)
    old_files = {record.get("path"): record for record in stored.get("files", []) if isinstance(record, dict)}
    for record in current.get("files", []):
        old = old_files.get(record["path"])
        if old is None:
            return f"{record['path']} was not read by the checkpointed run"
        if old.get("size") != record["size"]:
            return f"{record['path']} changed: {old.get('size')} bytes then, {record['size']} now"
        if old.get("sha256") != record["sha256"]:
            return f"{record['path']} changed: same size, different content"
        if not record["complete"] and old.get("mtime_ns") != record["mtime_ns"]:
            return f"{record['path']} was modified since (its content is only sampled, so the time decides)"
    return None
