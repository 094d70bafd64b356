"""Process signals: a graceful stop on SIGTERM/SIGINT, and fault points that SIGKILL the process on purpose.

A cluster scheduler sends SIGTERM before it takes a node back, and a user presses Ctrl-C: in both cases
the run should finish the step it is in, write a checkpoint and exit 0, so `--resume` loses nothing. A
second signal means "now": the process exits at once (status 128 + signal), relying on the atomic
checkpoint writes for safety.

Fault points make crash tests deterministic without test-only code paths: with
`FASTLM_FAULT_INJECT=<point>` (or `<point>@<n>` for the n-th time the point is reached, counting from 1)
the process sends itself SIGKILL there. Unset, a fault point costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)
FAULT_ENV = "FASTLM_FAULT_INJECT"

_fault_hits: dict[str, int] = {}


def _fault_target() -> tuple[str, int] | None:
    """The configured fault point and after how many hits it fires, or None."""
    spec = os.environ.get(FAULT_ENV, "").strip()
    if not spec:
        return None
    name, _, count = spec.partition("@")
    if count and not count.isdigit():
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected <point> or <point>@<n> with n >= 1")
    return name, int(count) if count else 1


def fault_point(name: str) -> None:
    """SIGKILL this process here when `FASTLM_FAULT_INJECT` names this point (crash-safety tests)."""
    target = _fault_target()
    if target is None or target[0] != name:
        return
    _fault_hits[name] = _fault_hits.get(name, 0) + 1
    if _fault_hits[name] == target[1]:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


class StopRequest:
    """While entered, the first SIGTERM/SIGINT only records itself (`requested`); a second one exits at once.

    Handlers can only be installed from the main thread; elsewhere (a trainer driven from a worker
    thread) the context manager does nothing and signals keep their previous behaviour.
    """

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        received = signal.Signals(signum)
        if self.signal is not None:
            print(f"fastlm: second signal ({received.name}): exiting now without a checkpoint", file=sys.stderr,
                  flush=True)
            os._exit(128 + signum)
        self.signal = received
        print(f"fastlm: {received.name} received: finishing this step, writing a checkpoint, then exiting "
              "(send it again to exit at once)", file=sys.stderr, flush=True)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for stop_signal in STOP_SIGNALS:
                self._previous[stop_signal] = signal.signal(stop_signal, self._handle)
        _entered.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self in _entered:
            _entered.remove(self)
        for stop_signal, handler in self._previous.items():
            signal.signal(stop_signal, handler)
        self._previous.clear()


_entered: list[StopRequest] = []


def stop_signal() -> str | None:
    """The stop signal an entered StopRequest has recorded, by name, or None (for code that waits on user code)."""
    return next((request.signal.name for request in _entered if request.signal is not None), None)
