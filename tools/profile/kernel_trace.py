"""What the device did during a few profiled steps: busy time against wall time, and time per kernel name.

`profile_steps` runs steps under torch.profiler (device activity only on CUDA, so the host is not slowed by
op recording) and reads the exported Chrome trace: the union of the kernel, memcpy and memset intervals is
the busy time, wall time minus it is where the device waited for the host. `kernel_differences` lines two
summaries up by kernel name, largest change per step first. On CPU the trace has no device activity; the
host's op events stand in (nested ones counted under each name), so the same code runs in smoke mode.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op",)
NAME_WIDTH = 80


@dataclass
class TraceSummary:
    """Device activity over `steps` profiled steps (seconds)."""

    label: str
    steps: int
    wall_seconds: float  # host clock over the steps, the device synchronised at both ends
    busy_seconds: float  # union of the device intervals
    events: int
    by_name: Counter[str] = field(default_factory=Counter)  # seconds per (shortened) kernel name

    def per_step_ms(self, seconds: float) -> float:
        return seconds / max(self.steps, 1) * 1e3

    @property
    def idle_seconds(self) -> float:
        return max(self.wall_seconds - self.busy_seconds, 0.0)


def short_name(name: str) -> str:
    """Templated CUDA kernel names run to hundreds of characters: keep the head."""
    return name if len(name) <= NAME_WIDTH else name[: NAME_WIDTH - 3] + "..."


def trace_events(trace: dict, categories: Iterable[str]) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of the complete events of `categories` in a Chrome trace."""
    wanted = set(categories)
    return [(str(e.get("name", "?")), float(e["ts"]), float(e["dur"])) for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and e.get("cat") in wanted and "ts" in e and "dur" in e]


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by (start, duration) intervals, overlaps counted once."""
    total, end = 0.0, float("-inf")
    for start, duration in sorted(intervals):
        stop = start + duration
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def summarize(label: str, trace: dict, steps: int, wall_seconds: float, categories: Iterable[str]) -> TraceSummary:
    events = trace_events(trace, categories)
    by_name: Counter[str] = Counter()
    for name, _, duration in events:
        by_name[short_name(name)] += duration / 1e6
    busy = union_length((start, duration) for _, start, duration in events) / 1e6
    return TraceSummary(label, steps, wall_seconds, busy, len(events), by_name)


def profile_steps(label: str, step: Callable[[int], None], steps: int, device: torch.device) -> TraceSummary:
    """Run `step(0..steps-1)` under torch.profiler and summarize its device activity (host ops on CPU)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    _synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as profiler:
        start = time.perf_counter()
        for index in range(steps):
            step(index)
        _synchronize(device)
        wall = time.perf_counter() - start
    with tempfile.TemporaryDirectory(prefix="fastlm-trace-") as folder:
        path = Path(folder, "trace.json")
        profiler.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return summarize(label, trace, steps, wall, DEVICE_CATEGORIES if cuda else HOST_CATEGORIES)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def kernel_differences(before: TraceSummary, after: TraceSummary, top: int = 8) -> list[tuple[str, float, float]]:
    """(name, ms per step in `before`, in `after`) of the `top` names whose time per step changed most."""
    names = set(before.by_name) | set(after.by_name)
    rows = [(name, before.per_step_ms(before.by_name[name]), after.per_step_ms(after.by_name[name])) for name in names]
    rows.sort(key=lambda row: abs(row[2] - row[1]), reverse=True)
    return rows[:top]


def profile_table(summaries: list[TraceSummary]) -> str:
    lines = ["| profile | wall ms/step | device busy ms/step | device idle ms/step | idle share | events/step |",
             "| --- | --- | --- | --- | --- | --- |"]
    for s in summaries:
        share = s.idle_seconds / s.wall_seconds if s.wall_seconds else 0.0
        lines.append(f"| {s.label} | {s.per_step_ms(s.wall_seconds):.2f} | {s.per_step_ms(s.busy_seconds):.2f} "
                     f"| {s.per_step_ms(s.idle_seconds):.2f} | {share:.1%} | {s.events / max(s.steps, 1):.0f} |")
    return "\n".join(lines)


def differences_table(before: TraceSummary, after: TraceSummary, top: int = 8) -> str:
    lines = [(f"largest per-kernel changes, {before.label} -> {after.label} (ms per step; total busy "
              f"{before.per_step_ms(before.busy_seconds):.2f} -> {after.per_step_ms(after.busy_seconds):.2f}):"),
             f"| kernel | {before.label} | {after.label} | change |", "| --- | --- | --- | --- |"]
    for name, first, second in kernel_differences(before, after, top):
        lines.append(f"| {name} | {first:.3f} | {second:.3f} | {second - first:+.3f} |")
    return "\n".join(lines)
