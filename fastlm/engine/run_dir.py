"""The run directory's lifecycle: one process at a time, and a failed start leaves it as it was found.

`RunDirLock` takes an OS lock (`flock`) on `<run dir>/.lock` before anything in the directory is read,
written or deleted; the kernel drops it when the process exits, however it exits (SIGKILL included), so
there is no stale lock to clean up by hand. A second `train`, `--resume` or `run.overwrite=true` on the
same directory is refused with the holder's pid and host (written into the lock file by the holder).

`FreshStart` remembers what a new run's directory held before the run began; if the run fails before
its first step is done (a bad batch, an out-of-memory model build), everything it added is removed, so
the next attempt starts as this one did instead of being refused as "an earlier run".
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path

LOCK_FILE = ".lock"


class RunDirError(RuntimeError):
    """The run directory cannot be used now (another process holds it); the message says which."""


def _holder(path: Path) -> str:
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder["started"])))
        return f"pid {int(holder['pid'])} on host {str(holder['host'])[:255]} (since {started})"
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return "another process (its pid is not recorded yet)"


class RunDirLock:
    """Exclusive, non-blocking `flock` on `<run dir>/.lock`; a context manager."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None
        self.created = False  # this process made the lock file (a failed start removes it again)

    def _open(self) -> int:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            self.created = True
            return fd
        except FileExistsError:
            return os.open(self.path, os.O_RDWR | os.O_CLOEXEC)

    def acquire(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                fd = self._open()
            except FileNotFoundError:  # removed between the two opens by a holder leaving: try again
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunDirError(f"run directory {self.run_dir} is in use by {_holder(self.path)}; wait for that "
                                  "run to end (or stop it), or choose another run.name") from None
            # The holder before us may have removed the file between our open and our lock: lock the live one.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self._fd = fd

    def release(self, remove: bool = False) -> None:
        """Unlock; `remove` also deletes the lock file (the directory is being left as it was found)."""
        if self._fd is None:
            return
        if remove:
            self.path.unlink(missing_ok=True)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunDirLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _entries(directory: Path) -> set[str]:
    return {path.name for path in directory.iterdir()} if directory.is_dir() else set()


class FreshStart:
    """What a new run's directory held before it began (top level and `checkpoints/`), so that a start
    that fails can remove exactly what it added and nothing else."""

    def __init__(self, run_dir: Path, checkpoint_dir: Path, existed: bool, lock: RunDirLock):
        self.run_dir, self.checkpoint_dir, self.existed = run_dir, checkpoint_dir, existed
        self.remove_lock = lock.created
        self.top = _entries(run_dir) | {LOCK_FILE}  # the lock file goes with the lock (`release(remove=...)`)
        self.checkpoints = _entries(checkpoint_dir)
        self.checkpoints_existed = checkpoint_dir.exists()

    def undo(self) -> None:
        """Remove what the failed start added (the caller still holds the lock)."""
        if self.checkpoints_existed:
            for name in _entries(self.checkpoint_dir) - self.checkpoints:
                _remove(self.checkpoint_dir / name)
        for name in _entries(self.run_dir) - self.top:
            _remove(self.run_dir / name)

    @property
    def remove_directory(self) -> bool:
        """The directory did not exist before: once emptied (but for the lock file) it goes too."""
        return not self.existed and _entries(self.run_dir) <= {LOCK_FILE}


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
