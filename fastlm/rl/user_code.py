"""User code (reward functions, environments) in a child process that the run can kill.

A timeout on a thread cannot stop code that holds the GIL (a catastrophic regex, `7**(10**9)`): the thread
that waits never runs again. So user reward functions and environments run in a child process of their
own (`UserCodeProcess`, one per loaded set of rewards or environment, started by its first call and
kept for the run; that call also imports the user's module). The
trainer waits for each reply at most its timeout and only until a SIGTERM/SIGINT arrives; then it kills
the child (SIGKILL) and reports `UserCodeAbandoned`, which the callers turn into a `RewardError` naming
the function or environment (the RL trainer then writes the checkpoint of the last finished step).

Requests are `(operation, arguments)`, replies `("ok", value)` or `("raised", "Type: message")`, pickled
over two pipes. What comes back is plain data (`plain`): None, bool, int, float, str, lists and dicts of
them; an array or tensor becomes its `tolist()`, anything else an `Opaque` naming its type. So nothing of
the user's runs in the trainer when a reply is read. The child imports only the standard library and
the user's modules (no torch unless they import it); it ignores SIGINT/SIGTERM (the trainer decides) and
dies with its parent (Linux's PR_SET_PDEATHSIG; EOF on its pipe elsewhere). Cost: docs/rl.md.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
import types
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from fastlm.system.signals import stop_signal

POLL_S = 0.05  # how often a wait looks at the stop signal
BOOTSTRAP = ("import json, sys; sys.path[:] = json.loads(sys.argv[3]); from fastlm.rl.user_code import serve; "
             "serve(int(sys.argv[1]), int(sys.argv[2]))")


class UserCodeError(RuntimeError):
    """User code raised or its process died; the message is what it did ("raised Type: message", "ended its
    process (exit status 1)"), to follow the name of the function or environment."""


class UserCodeAbandoned(UserCodeError):
    """User code did not reply within its timeout, or a stop signal arrived: its process was killed. The
    message says which ("did not return within ..." / "was still running when SIGTERM arrived")."""


@dataclass(frozen=True)
class Opaque:
    """A returned value that is not plain data, by its type's name (the trainer never sees the object)."""

    type_name: str

    def __repr__(self) -> str:
        return f"<{self.type_name} object>"


def plain(value: Any) -> Any:
    """`value` as plain data (see the module docstring); a RecursionError for nesting past the stack."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, (list, tuple, types.GeneratorType)):
        return [plain(item) for item in value]
    if isinstance(value, dict):
        return {plain(key): plain(item) for key, item in value.items()}
    if callable(getattr(value, "tolist", None)):  # numpy arrays and scalars, torch tensors
        return plain(value.tolist())
    return Opaque(type(value).__name__)


def _described(error: BaseException) -> str:
    try:
        return f"{type(error).__name__}: {error}"
    except BaseException:  # noqa: BLE001 - a user exception whose str() fails
        return type(error).__name__


class Objects:
    """The child's side: user callables and classes by "module:attribute" (imported on first use) and the
    instances it built, by handle."""

    def __init__(self) -> None:
        self.targets: dict[str, Any] = {}
        self.instances: dict[int, Any] = {}
        self.created = 0

    def target(self, path: str) -> Any:
        if path not in self.targets:
            module, attribute = path.split(":")
            self.targets[path] = getattr(importlib.import_module(module), attribute)
        return self.targets[path]

    def run(self, operation: str, arguments: tuple) -> Any:
        if operation == "call":  # path, keyword arguments
            return self.target(arguments[0])(**arguments[1])
        if operation == "create":  # path, keyword arguments: a handle
            self.created += 1
            self.instances[self.created] = self.target(arguments[0])(**arguments[1])
            return self.created
        if operation == "method":  # handle, method name, positional arguments
            return getattr(self.instances[arguments[0]], arguments[1])(*arguments[2])
        if operation == "drop":  # handles
            for handle in arguments[0]:
                self.instances.pop(handle, None)
            return None
        raise ValueError(f"unknown operation {operation!r}")


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel SIGKILLs this process when its parent exits, even while user code holds the GIL."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent was gone before the line above
        os._exit(1)


def serve(read_fd: int, write_fd: int) -> None:
    """The child's loop: one request, one reply, until the parent closes its pipe."""
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, signal.SIG_IGN)
    _die_with_parent(int(os.environ.get("FASTLM_USER_CODE_PARENT", os.getppid())))
    requests, replies = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    objects = Objects()
    while True:
        try:
            operation, arguments = requests.recv()
        except EOFError:
            return
        try:
            reply: tuple[str, Any] = ("ok", plain(objects.run(operation, arguments)))
        except BaseException as error:  # noqa: BLE001 - user code: reported to the trainer, never fatal here
            reply = ("raised", _described(error))
        try:
            replies.send(reply)
        except (ValueError, RecursionError, MemoryError) as error:  # a value too deep or too large to send
            replies.send(("raised", f"its value could not be sent back ({_described(error)})"))


class UserCodeProcess:
    """The trainer's side: `call` sends one request and waits for its reply (see the module docstring).
    The child starts at the first call with this process's `sys.path`; after a kill, the next call
    starts a fresh one."""

    def __init__(self) -> None:
        self._child: subprocess.Popen | None = None
        self._requests: Connection | None = None
        self._replies: Connection | None = None
        self._finalizer: weakref.finalize | None = None

    def _start(self) -> None:
        child_read, parent_write = os.pipe()
        parent_read, child_write = os.pipe()
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-c", BOOTSTRAP, str(child_read), str(child_write), json.dumps(sys.path)],
                pass_fds=(child_read, child_write), stdin=subprocess.DEVNULL,
                env={**os.environ, "FASTLM_USER_CODE_PARENT": str(os.getpid())})
        finally:
            os.close(child_read)
            os.close(child_write)
        self._requests = Connection(parent_write, readable=False)
        self._replies = Connection(parent_read, writable=False)
        self._finalizer = weakref.finalize(self, _kill, self._child, self._requests, self._replies)

    def call(self, operation: str, *arguments: Any, timeout_s: float) -> Any:
        """The reply's value; `UserCodeError` when the user code raised or its process died,
        `UserCodeAbandoned` (the process killed) past `timeout_s` or at a stop signal."""
        if self._child is None:
            self._start()
        assert self._requests is not None and self._replies is not None
        deadline = time.monotonic() + timeout_s
        try:
            self._requests.send((operation, arguments))
            while not self._replies.poll(min(POLL_S, max(deadline - time.monotonic(), 0.0))):
                stopped = stop_signal()
                if stopped is not None or time.monotonic() >= deadline:
                    self.close()
                    raise UserCodeAbandoned(f"was still running when {stopped} arrived" if stopped is not None
                                            else f"did not return within rl.reward_timeout_s = {timeout_s:g} s")
            status, value = self._replies.recv()
        except (EOFError, OSError) as error:  # the child died (os._exit, a crash, the OOM killer)
            try:
                code = self._child.wait(timeout=1.0) if self._child is not None else None
            except subprocess.TimeoutExpired:  # its pipe closed, but it still runs: it is killed below
                code = None
            self.close()
            raise UserCodeError(f"ended its process (exit status {code})") from error
        if status == "raised":
            raise UserCodeError(f"raised {value}")
        return value

    def close(self) -> None:
        """Kill the child (if any); a later call starts a fresh one."""
        if self._finalizer is not None:
            self._finalizer()
        self._child = self._requests = self._replies = self._finalizer = None


def _kill(child: subprocess.Popen, *pipes: Connection) -> None:
    for pipe in pipes:
        pipe.close()
    if child.poll() is None:
        child.kill()
    child.wait()
