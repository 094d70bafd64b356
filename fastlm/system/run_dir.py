"""The run directory's lifecycle: one process at a time, and a failed start leaves it as it was found.

`RunDirLock` takes an OS lock (`flock`) on `<run dir>/.lock` before anything in the directory is read,
written or deleted; the kernel drops it when the process exits, however it exits (SIGKILL included), so
there is no stale lock to clean up by hand. A second `train`, `--resume` or `run.overwrite=true` on the
same directory is refused with the holder's pid and host (written into the lock file by the holder).

`FreshStart` remembers what a new run's directory held before the run began; if the run fails before
its first step is done (a bad batch, an out-of-memory model build), everything it added is removed, so
the next attempt starts as this one did instead of being refused as "an earlier run".

Files of the run directory (`.lock`, `metrics.jsonl`, checkpoint pointers and manifests) are opened with
`open_run_file`: never through a symbolic link and only when they are regular files, so a planted link
cannot make a run write (or read) outside its folder, and a FIFO or directory in their place is one line.
`ReplacedRun` is `run.overwrite=true`'s safety net: the earlier run is set aside, not deleted, until the
new run's first checkpoint exists, and put back when the new run fails (or was killed) before it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import stat
import time
from pathlib import Path

from fastlm.system.json_text import parse_json
from fastlm.system.signals import fault_point

LOCK_FILE = ".lock"
LOCK_WAIT_S = 10.0  # a lock file replaced under us again and again: give up after this long


class RunDirError(RuntimeError):
    """The run directory cannot be used now (another process holds it); the message says which."""


def _kind(mode: int) -> str:
    kinds = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
             stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFLNK: "a symbolic link"}
    return kinds.get(stat.S_IFMT(mode), "not a regular file")


def open_run_file(path: Path, flags: int, mode: int = 0o644) -> int:
    """`os.open` of a run-directory file that is never a symbolic link and always a regular file
    (a FIFO does not block: O_NONBLOCK); anything else is a `RunDirError` naming the path and the fix."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EMLINK):
            try:
                kind = _kind(os.lstat(path).st_mode)
            except OSError:
                kind = "not a regular file"
            raise RunDirError(f"{path}: is {kind}, not a regular file; fastlm never follows or writes through it "
                              "(a run's files stay in its folder): remove it and run again") from None
        raise
    kind = os.fstat(fd).st_mode
    if not stat.S_ISREG(kind):
        os.close(fd)
        raise RunDirError(f"{path}: is {_kind(kind)}, not a regular file; remove it and run again")
    os.set_blocking(fd, True)
    return fd


def _holder(fd: int) -> str:
    """Who holds the lock, from the first KiBs of its file (anything else written there: unknown)."""
    try:
        holder = parse_json(os.pread(fd, 4096, 0))
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder["started"])))
        return f"pid {int(holder['pid'])} on host {str(holder['host'])[:255]} (since {started})"
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return "another process (its pid is not recorded yet)"


class RunDirLock:
    """Exclusive, non-blocking `flock` on `<run dir>/.lock`; a context manager."""

    def __init__(self, run_dir: Path, path: Path | None = None, label: str = "run directory",
                 instead: str = "choose another run.name"):
        """`path`: the lock file (default `<run_dir>/.lock`); `label` and `instead` word the refusal."""
        self.run_dir = Path(run_dir)
        self.path = Path(path) if path is not None else self.run_dir / LOCK_FILE
        self.label, self.instead = label, instead
        self._fd: int | None = None
        self.created = False  # this process made the lock file (a failed start removes it again)

    def _open(self) -> int:
        try:
            fd = open_run_file(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            self.created = True
            return fd
        except FileExistsError:
            return open_run_file(self.path, os.O_RDWR)

    def acquire(self) -> None:
        """Take the lock now or raise `RunDirError` (a holder is named; never a wait on a live run). A lock
        file that keeps vanishing between open and lock (holders leaving) is retried for `LOCK_WAIT_S`."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            if time.monotonic() > deadline:
                raise RunDirError(f"{self.path}: could not take the lock within {LOCK_WAIT_S:.0f} s (the file was "
                                  "replaced at every try); stop whatever rewrites it, then run again")
            try:
                fd = self._open()
            except FileNotFoundError:  # removed between the two opens by a holder leaving: try again
                time.sleep(0.01)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise RunDirError(f"{self.label} {self.run_dir} is in use by {holder}; wait for that "
                                  f"process to end (or stop it), or {self.instead}") from None
            # The holder before us may have removed the file between our open and our lock: lock the live one.
            try:
                same = os.lstat(self.path).st_ino == os.fstat(fd).st_ino
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

    def __enter__(self) -> RunDirLock:
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


ASIDE_DIR = ".replaced.partial"  # the earlier run while it is being set aside or put back
REPLACED_DIR = ".replaced"  # the earlier run, whole, while the new run has no checkpoint yet


class ReplacedRun:
    """`run.overwrite=true`: the earlier run's entries moved into `<run>/.replaced/` (each a rename, so a kill
    at any point leaves every entry in one of two known places), deleted once the new run has a checkpoint
    (`discard`), put back when it fails before one (`restore`, or `recover_replaced` after a kill)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    @classmethod
    def set_aside(cls, run_dir: Path, names: list[str]) -> ReplacedRun:
        partial = run_dir / ASIDE_DIR
        partial.mkdir()
        for name in names:
            if os.path.lexists(run_dir / name):
                os.rename(run_dir / name, partial / name)
                fault_point("overwrite_moving_aside")
        fsync_dir(run_dir)
        os.rename(partial, run_dir / REPLACED_DIR)  # from here on the new run may write its own entries
        fsync_dir(run_dir)
        fault_point("overwrite_set_aside")
        return cls(run_dir)

    def discard(self) -> None:
        _remove(self.run_dir / REPLACED_DIR)

    def restore(self) -> None:
        os.rename(self.run_dir / REPLACED_DIR, self.run_dir / ASIDE_DIR)
        _put_back(self.run_dir)


def _put_back(run_dir: Path) -> None:
    """Move every entry of the aside directory back, replacing what the new run wrote under that name;
    per entry (remove, then rename), so running it again after a kill finishes the job."""
    partial = run_dir / ASIDE_DIR
    for entry in sorted(partial.iterdir()):
        target = run_dir / entry.name
        if os.path.lexists(target):
            _remove(target)
        os.rename(entry, target)
        fault_point("overwrite_putting_back")
    partial.rmdir()
    fsync_dir(run_dir)


def recover_replaced(run_dir: Path, checkpointed: bool) -> str | None:
    """Finish what a killed `run.overwrite=true` left (called under the lock, before anything is read):
    the earlier run goes back unless the new one reached a checkpoint (`checkpointed`: the run directory
    holds a complete one). A line for the user, or None."""
    if (run_dir / REPLACED_DIR).is_dir() and checkpointed:
        ReplacedRun(run_dir).discard()
        return None
    if (run_dir / REPLACED_DIR).is_dir():
        os.rename(run_dir / REPLACED_DIR, run_dir / ASIDE_DIR)
    if not (run_dir / ASIDE_DIR).is_dir():
        return None
    _put_back(run_dir)
    return (f"{run_dir}: restored the earlier run that run.overwrite=true had set aside (the new run stopped "
            "before its first checkpoint)")


def fsync_dir(directory: Path) -> None:
    """Make a rename or removal in `directory` durable (the entries, not only the files)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
