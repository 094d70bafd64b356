"""The rollout benchmark's CPU mode generates end to end, and its bandwidth bound counts the bytes it says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from bench_rollouts import bound_seconds, load_model, long_tail_lengths  # noqa: E402


def test_bench_rollouts_cpu_smoke() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_rollouts.py"), "--cpu-smoke"],
                            capture_output=True, text=True, timeout=300, check=True)
    assert "4 x 6 tokens generated" in result.stdout


def test_grpo_workload_cpu_smoke() -> None:
    """The long-tailed workload: the static generator and the engine on the same forced lengths."""
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_rollouts.py"), "--workload", "grpo",
                             "--cpu-smoke"], capture_output=True, text=True, timeout=300, check=True)
    assert "| tiny-llama | engine |" in result.stdout and "| tiny-llama | static |" in result.stdout, result.stdout


def test_long_tail_lengths_have_the_asked_median_and_cap() -> None:
    lengths = long_tail_lengths(512, 500.0, 1.0, 4096, seed=2)
    ordered = sorted(lengths)
    print(f"median {ordered[256]}, mean {sum(lengths) / 512:.0f}, max {max(lengths)}, at cap {lengths.count(4096)}")
    assert 400 < ordered[256] < 625 and max(lengths) <= 4096 and min(lengths) >= 1
    assert lengths == long_tail_lengths(512, 500.0, 1.0, 4096, seed=2)


def test_bound_counts_weights_and_cache() -> None:
    """llama-350m, B=64: bf16 matrices (no embedding table) + the growing bf16 KV cache, per decode step."""
    model = load_model("llama-350m", torch.device("meta"))
    config = model.config
    matrices = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith("embeddings."))
    kv_per_token = 2 * config.num_layers * config.kv_heads * config.head_dim * 2
    one_step = (2 * matrices + 2 * 64 * config.hidden_size + 64 * kv_per_token * (128 + 1 + 1)) / 1e12
    assert abs(bound_seconds(model, 64, 128, 2, 1e12) - one_step) < 1e-12
    print(f"llama-350m: {2 * matrices / 1e9:.2f} GB of bf16 matrices, {kv_per_token} KV bytes per token")
