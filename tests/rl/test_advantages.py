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
    with pytest.raises(ValueError, match="rewards has infinite values at \\[2\\]"):
        group_advantages(torch.tensor([0.0, 1.0, math.inf, 1.0]), 2)


def _trl_nanstd(tensor: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """TRL's trainer/utils.py nanstd, as written there (variance over non-NaN values, Bessel's correction)."""
    if dim is None:
        variance = torch.nanmean((tensor - torch.nanmean(tensor)) ** 2)
        count = torch.sum(~torch.isnan(tensor))
    else:
        variance = torch.nanmean((tensor - torch.nanmean(tensor, dim=dim, keepdim=True)) ** 2, dim=dim)
        count = torch.sum(~torch.isnan(tensor), dim=dim)
    return torch.sqrt(variance * count / (count - 1))


def _trl_advantages(rewards: torch.Tensor, group: int, scale: str) -> torch.Tensor:
    """TRL GRPOTrainer._generate_and_score_completions (sum_then_normalize), NaN = unscored."""
    mean = torch.nanmean(rewards.view(-1, group), dim=1).repeat_interleave(group)
    std = (_trl_nanstd(rewards.view(-1, group), dim=1).repeat_interleave(group) if scale in ("group", "none")
           else _trl_nanstd(rewards).expand_as(rewards))
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_unscored_completions_are_left_out_of_their_group_like_trl(scale: str) -> None:
    generator = torch.Generator().manual_seed(3)
    rewards = torch.rand(5 * 4, generator=generator, dtype=torch.float64)
    rewards[[1, 6, 7, 13, 14, 15, 16, 17, 18, 19]] = torch.nan  # groups with 3, 2, 1 and 0 scored, one complete
    got = group_advantages(rewards, 4, scale, 1e-4)
    want = _trl_advantages(rewards, 4, scale)
    error = float((got - want).abs().max() / want.abs().max())
    print(f"advantages with unscored completions ({scale}) vs TRL's formula: {error:.2e}")
    assert error < 1e-12 and torch.isfinite(got).all()
    assert (got[rewards.isnan()] == 0).all()
    assert abs(float(got[[0, 2, 3]].sum())) < 1e-12  # centred on the scored ones (not on a 0 for the unscored)
    metrics = rollout_metrics(rewards, got, torch.full((20,), 3), torch.ones(20, dtype=torch.bool), 4)
    assert metrics["reward"] == pytest.approx(float(rewards[~rewards.isnan()].mean()))
