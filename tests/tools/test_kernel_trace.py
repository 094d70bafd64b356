"""tools/profile/kernel_trace.py reads busy time and per-kernel time from a profiler trace; tools/profile/gpu_clocks.py parses
nvidia-smi samples. Both feed `bench_train.py --compare-cli`'s decomposition of the CLI trainer's gap."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "profile"))

from gpu_clocks import ClockSampler, parse_sample  # noqa: E402
from kernel_trace import kernel_differences, profile_steps, summarize, union_length  # noqa: E402


def _event(name: str, start: float, duration: float, category: str = "kernel", phase: str = "X") -> dict:
    return {"ph": phase, "cat": category, "name": name, "ts": start, "dur": duration}


def test_union_length_counts_overlaps_once() -> None:
    # [0, 10) and [5, 12) overlap, [2, 4) is inside, [20, 21) stands alone: 12 + 1
    assert union_length([(5, 7), (0, 10), (2, 2), (20, 1)]) == 13
    assert union_length([]) == 0


def test_summarize_takes_device_events_only() -> None:
    trace = {"traceEvents": [
        _event("gemm", 0, 400), _event("gemm", 1000, 400), _event("Memcpy HtoD", 300, 200, "gpu_memcpy"),
        _event("aten::mm", 0, 5000, "cpu_op"), _event("cudaLaunchKernel", 0, 5, "cuda_runtime"),
        _event("flow", 0, 1, "kernel", phase="f"),
    ]}
    summary = summarize("x", trace, steps=2, wall_seconds=0.004, categories=("kernel", "gpu_memcpy", "gpu_memset"))
    assert summary.events == 3
    assert summary.busy_seconds == pytest.approx(900e-6)  # [0, 500) and [1000, 1400)
    assert summary.idle_seconds == pytest.approx(0.004 - 900e-6)
    assert summary.by_name["gemm"] == pytest.approx(800e-6)
    assert summary.per_step_ms(summary.by_name["gemm"]) == pytest.approx(0.4)


def test_kernel_differences_orders_by_change_per_step() -> None:
    before = summarize("a", {"traceEvents": [_event("k1", 0, 100), _event("k2", 200, 300)]}, 1, 1e-3, ("kernel",))
    after = summarize("b", {"traceEvents": [_event("k1", 0, 110), _event("k3", 200, 50)]}, 1, 1e-3, ("kernel",))
    rows = kernel_differences(before, after)
    assert [name for name, _, _ in rows] == ["k2", "k3", "k1"]
    assert rows[0][1:] == pytest.approx((0.3, 0.0))


def test_profile_steps_on_cpu_reads_its_own_trace() -> None:
    weight = torch.randn(64, 64)
    summary = profile_steps("cpu", lambda index: weight @ weight, 2, torch.device("cpu"))
    assert summary.steps == 2 and summary.events >= 2
    assert 0 < summary.busy_seconds <= summary.wall_seconds
    assert any("mm" in name for name in summary.by_name)


def test_parse_sample_keeps_this_gpu_and_skips_missing_values() -> None:
    assert parse_sample("0, 1980, 645.31, 61", 0) == (1980.0, 645.31, 61.0)
    assert parse_sample("1, 1980, 645.31, 61", 0) is None
    assert parse_sample("0, 1980, [N/A], 61", 0) is None
    assert parse_sample("garbage", 0) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the sampler's behaviour without CUDA")
def test_clock_sampler_without_cuda_samples_nothing() -> None:
    with ClockSampler() as sampler:
        assert sampler.process is None
        assert sampler.mean(0.0, float("inf")) is None
