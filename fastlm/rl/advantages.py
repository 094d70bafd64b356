"""Group-relative advantages (GRPO) and the rollout statistics that are not additive over micro-batches.

Rewards arrive flat, prompt-major: completions g = 0..G-1 of prompt k sit at k*G + g. The advantage is
the reward minus its group's mean, divided (TRL's `scale_rewards`) by the group's std, the whole
batch's std, or nothing; `eps` keeps a zero std finite (a group whose rewards are all equal then gets
advantage 0 everywhere: no signal, not NaN). Stds are unbiased (torch.std), as in TRL.
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
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError(f"rewards has non-finite values at {torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()}")
    return rewards.view(-1, group_size)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: ScaleRewards = "group", eps: float = 1e-4) -> torch.Tensor:
    """(P*G,) rewards -> (P*G,) advantages."""
    grouped = _grouped(rewards, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        centred = centred / (rewards.std() + eps)
    elif scale != "none":
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    return centred.reshape(-1)


def rollout_metrics(
    rewards: torch.Tensor, advantages: torch.Tensor, lengths: torch.Tensor, stopped: torch.Tensor, group_size: int
) -> dict[str, float]:
    """TRL-named rollout statistics (without the `train/` prefix).

    reward_std is the mean over groups of each group's std (what GRPO normalises by);
    frac_reward_zero_std the share of groups whose rewards are all equal (they carry no gradient);
    completion lengths count the stop token; clipped_ratio is the share that hit the budget without stopping.
    """
    grouped = _grouped(rewards, group_size)
    group_std = grouped.std(dim=1)
    lengths = lengths.float()
    return {
        "reward": float(rewards.mean()),
        "reward_std": float(group_std.mean()),
        "frac_reward_zero_std": float((grouped.amax(dim=1) == grouped.amin(dim=1)).float().mean()),
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float((~stopped).float().mean()),
        "advantage/std": float(advantages.std()) if advantages.numel() > 1 else 0.0,
        "advantage/min": float(advantages.min()),
        "advantage/max": float(advantages.max()),
    }
