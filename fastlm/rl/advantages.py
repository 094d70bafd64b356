"""Group-relative advantages (GRPO) and the rollout statistics that are not additive over micro-batches.

Rewards arrive flat, prompt-major: completions g = 0..G-1 of prompt k sit at k*G + g. The advantage is
the reward minus its group's mean, divided (TRL's `scale_rewards`) by the group's std, the whole
batch's std, or nothing; `eps` keeps a zero std finite (a group whose rewards are all equal then gets
advantage 0 everywhere: no signal, not NaN). Stds are unbiased (torch.std), as in TRL.

A NaN reward is a completion no reward function scored: as in TRL it is left out of its group's mean
and std (and the batch's), and its advantage is 0; a group with one scored completion has no std, so
with `scale: group` its advantages are 0 too (TRL's nanstd is NaN there).
"""

from __future__ import annotations

from typing import Literal

import torch

ScaleRewards = Literal["group", "batch", "none"]


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1 or group_size < 2 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be a flat tensor whose length is a multiple of group_size >= 2; "
            f"got shape {tuple(rewards.shape)} and group_size {group_size}"
        )
    if bool(rewards.isinf().any()):
        raise ValueError(f"rewards has infinite values at {torch.nonzero(rewards.isinf()).flatten().tolist()}")
    return rewards.view(-1, group_size)


def nanstd(values: torch.Tensor, dim: int) -> torch.Tensor:
    """The unbiased std of the non-NaN values along `dim` (NaN with fewer than two), kept as a size-1 dim."""
    count = (~values.isnan()).sum(dim=dim, keepdim=True)
    squares = torch.nansum((values - torch.nanmean(values, dim=dim, keepdim=True)) ** 2, dim=dim, keepdim=True)
    return torch.sqrt(torch.where(count > 1, squares / (count - 1).clamp(min=1), torch.nan))


def group_advantages(rewards: torch.Tensor, group_size: int, scale: ScaleRewards = "group", eps: float = 1e-4) -> torch.Tensor:
    """(P*G,) rewards (NaN: unscored) -> (P*G,) advantages (0 where unscored)."""
    grouped = _grouped(rewards, group_size)
    centred = grouped - torch.nanmean(grouped, dim=1, keepdim=True)
    if scale == "group":
        centred = centred / (nanstd(grouped, dim=1) + eps)
    elif scale == "batch":
        centred = centred / (nanstd(rewards, dim=0) + eps)
    elif scale != "none":
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    return torch.nan_to_num(centred.reshape(-1), nan=0.0)


def rollout_metrics(
    rewards: torch.Tensor, advantages: torch.Tensor, lengths: torch.Tensor, stopped: torch.Tensor, group_size: int
) -> dict[str, float]:
    """TRL-named rollout statistics (without the `train/` prefix), over the scored completions.

    reward_std is the mean over groups of each group's std (what GRPO normalises by; groups with fewer
    than two scored completions left out); frac_reward_zero_std the share of groups whose scored rewards
    are all equal (they carry no gradient); completion lengths count the stop token; clipped_ratio is
    the share that hit the budget without stopping.
    """
    grouped = _grouped(rewards, group_size)
    group_std = nanstd(grouped, dim=1)
    lengths = lengths.float()
    scored_max = torch.where(grouped.isnan(), -torch.inf, grouped).amax(dim=1)
    scored_min = torch.where(grouped.isnan(), torch.inf, grouped).amin(dim=1)
    return {
        "reward": float(torch.nanmean(rewards)),
        "reward_std": float(torch.nanmean(group_std)),
        "frac_reward_zero_std": float((scored_max <= scored_min).float().mean()),
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float((~stopped).float().mean()),
        "advantage/std": float(advantages.std()) if advantages.numel() > 1 else 0.0,
        "advantage/min": float(advantages.min()),
        "advantage/max": float(advantages.max()),
    }
