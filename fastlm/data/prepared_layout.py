"""The files of a folder written by `fastlm prepare` (fastlm/data/prepared.py reads and writes them). A leaf:
the data config names a prepared source's files (the checkpoint's data fingerprint) without the reader."""

from __future__ import annotations

from pathlib import Path

TOKENS_FILE, OFFSETS_FILE, TARGETS_FILE, METADATA_FILE = "tokens.bin", "documents.npy", "targets.bin", "metadata.json"


def prepared_files(path: str | Path) -> list[str]:
    """The files of a prepared directory that exist, metadata first (targets.bin only when written)."""
    directory = Path(path)
    names = (METADATA_FILE, TOKENS_FILE, OFFSETS_FILE, TARGETS_FILE)
    return [str(directory / name) for name in names if (directory / name).is_file()]
