"""What a run trained on, recorded in every checkpoint, so a resume on changed data is caught.

A source's fingerprint is its config (generated corpora are fully described by it) plus, for every
file it reads, the resolved path, size, modification time and a sha256 of the content: the whole file
up to `FULL_HASH_BYTES`, beyond that `SAMPLES` evenly spaced blocks (bounded cost on a 100 GB memmap),
where the modification time stands in for the unsampled bytes.

Sources name their files through `data_files()` when they have one, else every `path` / `*_path` field,
nested ones included (a blend's entries), is a file or a directory of files (a `fastlm prepare` output).
`fingerprint_files` is the building block for anything else that reads files.
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


def _path_fields(node: Any) -> list[Path]:
    """Every `path` / `*_path` string of a config, nested sections and lists included (a blend's entries)."""
    if isinstance(node, BaseModel):
        found = []
        for name, value in node:
            if isinstance(value, str) and (name == "path" or name.endswith("_path")):
                found.append(Path(value))
            else:
                found += _path_fields(value)
        return found
    if isinstance(node, (list, tuple)):
        return [path for item in node for path in _path_fields(item)]
    return []


def source_files(source: BaseModel) -> list[Path]:
    """The files a data source reads: its `data_files()` if it has one, else its path fields, where a
    directory (a prepared data set) stands for every regular file under it, in sorted order."""
    own = getattr(source, "data_files", None)
    paths = [Path(path) for path in own()] if callable(own) else _path_fields(source)
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files += sorted(child for child in path.rglob("*") if child.is_file())
        else:
            files.append(path)
    return files


def data_fingerprint(source: BaseModel, tokenizer: str | None = None) -> dict[str, Any]:
    """The source's config, the fingerprint of every file it reads, and the tokenizer's fingerprint
    (the same text under another tokenizer is other training data)."""
    return {"source": source.model_dump(mode="json"), "files": fingerprint_files(source_files(source)),
            "tokenizer": tokenizer}


def _without_paths(node: Any) -> Any:
    """A source config without its file locations: moved data with the same content is the same data."""
    if isinstance(node, dict):
        return {key: _without_paths(value) for key, value in node.items() if not (key == "path" or key.endswith("_path"))}
    if isinstance(node, list):
        return [_without_paths(item) for item in node]
    return node


def describe_change(stored: dict[str, Any], current: dict[str, Any]) -> str | None:
    """What differs between a checkpoint's fingerprint and today's data, in words; None if nothing does.
    Files are compared in order by content (size, hash; the time only where the hash is sampled)."""
    before, now = _without_paths(stored.get("source") or {}), _without_paths(current.get("source") or {})
    if before != now:
        keys = sorted(key for key in set(before) | set(now) if before.get(key) != now.get(key))
        return "data.source changed: " + ", ".join(f"{key} {before.get(key)!r} -> {now.get(key)!r}" for key in keys)
    if stored.get("tokenizer") not in (None, current.get("tokenizer")):
        return f"the tokenizer changed (fingerprint {stored.get('tokenizer')} then, {current.get('tokenizer')} now)"
    old_files = [record for record in stored.get("files", []) if isinstance(record, dict)]
    new_files = current.get("files", [])
    if len(old_files) != len(new_files):
        return f"the source reads {len(new_files)} files now, {len(old_files)} then"
    for old, record in zip(old_files, new_files):
        if old.get("size") != record["size"]:
            return f"{record['path']} changed: {old.get('size')} bytes then, {record['size']} now"
        if old.get("sha256") != record["sha256"]:
            return f"{record['path']} changed: same size, different content"
        if not record["complete"] and old.get("mtime_ns") != record["mtime_ns"]:
            return f"{record['path']} was modified since (its content is only sampled, so the time decides)"
    return None
