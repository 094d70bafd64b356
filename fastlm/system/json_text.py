"""Bounded JSON: reading a file that may be hostile (huge, nested 100k deep, not UTF-8) is one line, never a
traceback. The readers of metadata, manifests, HF and PEFT configs and lock files all go through here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class JsonTextError(ValueError):
    """Why some bytes are not the JSON a reader expected (one line, without the file's name)."""


def parse_json(raw: bytes) -> Any:
    """The JSON value of `raw` (UTF-8); any failure, a nesting past Python's recursion limit included, is a
    `JsonTextError` saying why."""
    try:
        return json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise JsonTextError("nested too deeply") from None
    except UnicodeDecodeError:
        raise JsonTextError("not UTF-8") from None
    except ValueError as error:  # JSONDecodeError, or an integer of more than 4300 digits
        raise JsonTextError(str(error)[:200]) from None


def read_json_bytes(path: Path, limit: int) -> bytes:
    """At most `limit` bytes of a regular file; a larger one is a `JsonTextError` (nothing more is read)."""
    if not path.is_file():
        raise JsonTextError("missing or not a regular file")
    with path.open("rb") as handle:
        raw = handle.read(limit + 1)
    if len(raw) > limit:
        raise JsonTextError(f"larger than {limit:,} bytes")
    return raw
