"""Group advantages and rollout statistics against plain float64 loops."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from fastlm.rl.advantages import group_advantages, rollout_metrics


def _reference(rewards: list[float], group: int, scale: str, eps: float) -> list[float]:
    out = []
    batch_std = statistics.stdev(rewards)
    for start in range(0, len(rewards), group):
        values = rewards[start : start + group]
        mean = sum(values) / group
        std = {"group": statistics.stdev(values), "batch": batch_std, "none": None}[scale]
        out += [(v - mean) / (std + eps) if std is not None else v - mean for v in values]
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_float64_reference(scale: str) -> None:
    generator = torch.Generator().manual_seed(7)
    rewards = torch.rand(6 * 4, generator=generator, dtype=torch.float64)
    rewards[8:12] = 0.5  # one group with zero std: advantages 0, never NaN
    got = group_advantages(rewards, 4, scale, 1e-4)
    want = torch.tensor(_reference(rewards.tolist(), 4, scale, 1e-4), dtype=torch.float64)
    error = float((got - want).abs().max() / want.abs().max())
    print(f"advantages ({scale}) rel err vs float64 loop: {error:.2e}")
    assert error < 1e-12
    assert torch.all(got[8:12] == 0)
    assert abs(float(got.view(6, 4).sum(1).abs().max())) < 1e-12  # centred per group


def test_rollout_metrics_values() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.1, 0.1, 0.1, 0.1], dtype=torch.float64)
    advantages = group_advantages(rewards, 4)
    lengths = torch.tensor([2, 3, 2, 4, 2, 2, 2, 4])
    stopped = torch.tensor([True] * 7 + [False])
    metrics = rollout_metrics(rewards, advantages, lengths, stopped, 4)
    assert metrics["reward"] == pytest.approx(0.3)
    assert metrics["reward_std"] == pytest.approx(statistics.stdev([1.0, 0.0, 1.0, 0.0]) / 2)
    assert metrics["frac_reward_zero_std"] == 0.5
    assert metrics["completions/mean_length"] == pytest.approx(21 / 8)
    assert metrics["completions/clipped_ratio"] == 0.125
    assert metrics["advantage/max"] == pytest.approx(float(advantages.max()))
    assert metrics["advantage/min"] == pytest.approx(float(advantages.min()))
    assert math.isfinite(metrics["advantage/std"])


def test_bad_rewards_are_named() -> None:
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(torch.ones(5), 4)
    with pytest.raises(ValueError, match="rewards has non-finite values at \\[2\\]"):
        group_advantages(torch.tensor([0.0, 1.0, math.nan, 1.0]), 2)
