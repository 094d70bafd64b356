"""A full disk is one clear line: what could not be written, how much it needed, how much is free.

Writers catch their own failure and hand it to `raise_if_disk_full`, which turns ENOSPC / EDQUOT
(also when a library hides the errno, as torch.save's "file write failed" does) into `DiskFullError`;
any other failure is re-raised as it was.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_FULL_WORDS = ("no space left on device", "disk quota exceeded", "file write failed")


class DiskFullError(RuntimeError):
    """Writing failed because the file system is full; the message says what and how much."""


def free_bytes(path: Path) -> int:
    """Free bytes on the file system holding `path` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _mib(size: int) -> str:
    return f"{size / 2**20:,.1f} MiB"


def is_disk_full(error: BaseException) -> bool:
    if isinstance(error, OSError) and error.errno in _FULL_ERRNOS:
        return True
    return any(words in str(error).lower() for words in _FULL_WORDS)


def raise_if_disk_full(error: BaseException, what: str, where: Path, needed: int, intact: str = "",
                       then: str = "run again") -> None:
    """Raise `DiskFullError` for `error` if it is a full disk (`what`: the thing being written;
    `intact`: what is still safe, e.g. the previous checkpoint; `then`: what to do once space is free);
    otherwise return (the caller re-raises)."""
    free = free_bytes(where)
    if is_disk_full(error) or (isinstance(error, (OSError, RuntimeError)) and free < needed):
        raise DiskFullError(f"no space left on device writing {what} in {where}: it needs about {_mib(needed)}, "
                            f"{_mib(free)} is free{'; ' + intact if intact else ''}. Free some space and {then}") from None


def ensure_space(where: Path, needed: int, what: str, intact: str = "") -> None:
    """Refuse to start work whose next write cannot fit (e.g. resuming on a still-full disk)."""
    free = free_bytes(where)
    if free < needed:
        raise DiskFullError(f"not enough space in {where} for {what}: it needs about {_mib(needed)}, {_mib(free)} "
                            f"is free{'; ' + intact if intact else ''}. Free some space (or move run.output_dir) first")
