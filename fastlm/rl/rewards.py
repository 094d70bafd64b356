"""Rewards as user code (TRL's reward-function convention).

`rl.rewards: [{function: "package.module:name", weight: 1.0}]`. A function is called once per rollout with
keyword arguments, one list entry per completion (prompt-major, G per prompt):

    prompts: list[str], completions: list[str], completion_ids: list[list[int]], stopped: list[bool],
    plus every extra column of the prompt records (e.g. `answer`), repeated for the G completions,

and returns one float (or None: "no reward from this function") per completion; accept `**kwargs` for
columns you do not use. The total reward is the weighted sum over the functions that gave one; a completion
none scored is left out of its group's mean and std and gets advantage 0 (TRL). A function that raises,
returns the wrong count or a non-number stops the run with a `RewardError` naming the function and the
prompt index; a NaN does too, or counts as None with `rl.nan_rewards: skip`.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fastlm.config.errors import ConfigError, ConfigIssue
from fastlm.rl.config import RewardConfig

RewardCallable = Callable[..., Sequence[float | None]]


class RewardError(RuntimeError):
    """A reward function failed; the message names it and the prompt index (no traceback for the user)."""


@dataclass(frozen=True)
class RewardFunction:
    name: str  # metric name: train/rewards/<name>/{mean,std}
    path: str  # "package.module:name", for messages
    function: RewardCallable
    weight: float


def load_reward_functions(configs: list[RewardConfig]) -> list[RewardFunction]:
    """Import every configured function; a bad path is a `ConfigError` at `rl.rewards[i].function`."""
    functions, issues = [], []
    for index, config in enumerate(configs):
        where = f"rl.rewards[{index}].function"
        module_name, attribute = config.function.split(":")
        try:
            module = importlib.import_module(module_name)
        except Exception as error:  # noqa: BLE001 - any import failure of user code is a config problem
            issues.append(ConfigIssue(where, f"cannot import module '{module_name}': {type(error).__name__}: {error}",
                                      config.function, hint="check the module path and that it is on PYTHONPATH"))
            continue
        function = getattr(module, attribute, None)
        if not callable(function):
            issues.append(ConfigIssue(where, f"module '{module_name}' has no function '{attribute}'", config.function))
            continue
        functions.append(RewardFunction(config.metric_name, config.function, function, config.weight))
    names = [f.name for f in functions]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        issues.append(ConfigIssue("rl.rewards", f"two reward functions share the metric name(s) {duplicates}",
                                  names, hint="give each a distinct `name:`"))
    if issues:
        raise ConfigError(issues)
    return functions


def _call(reward: RewardFunction, arguments: dict[str, list[Any]], group_size: int) -> list[Any]:
    """The function's values; on an exception, locate the first completion that raises (one at a time)."""
    try:
        return list(reward.function(**arguments))
    except Exception as error:  # noqa: BLE001 - user code: report which prompt, with the original error
        failing = "?"
        for index in range(len(arguments["completions"])):
            try:
                reward.function(**{key: values[index : index + 1] for key, values in arguments.items()})
            except Exception:  # noqa: BLE001
                failing = str(index // group_size)
                break
        raise RewardError(f"reward function '{reward.name}' ({reward.path}) raised {type(error).__name__}: {error} "
                          f"(prompt index {failing} of this rollout)") from error


def _value(reward: RewardFunction, value: Any, index: int, group_size: int, nan_policy: str) -> float:
    """One returned value as a float (NaN = no reward), or a RewardError naming the prompt."""
    where = f"reward function '{reward.name}' ({reward.path}), prompt index {index // group_size} (completion {index})"
    if value is None:
        return math.nan
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RewardError(f"{where}: returned {type(value).__name__} {value!r}, expected a float or None")
    value = float(value)
    if math.isinf(value) or (math.isnan(value) and nan_policy == "error"):
        raise RewardError(f"{where}: returned {value}; return a finite float or None "
                          "(or set rl.nan_rewards: skip to count NaN as no reward)")
    return value


def score_completions(
    functions: list[RewardFunction],
    arguments: dict[str, list[Any]],
    group_size: int,
    nan_policy: str = "error",
) -> torch.Tensor:
    """(N, F) float64 rewards, NaN where a function gave none (see the module docstring for `arguments`)."""
    count = len(arguments["completions"])
    columns = []
    for reward in functions:
        values = _call(reward, arguments, group_size)
        if len(values) != count:
            raise RewardError(f"reward function '{reward.name}' ({reward.path}) returned {len(values)} values for "
                              f"{count} completions (prompt index 0 onwards); return one per completion")
        columns.append([_value(reward, v, i, group_size, nan_policy) for i, v in enumerate(values)])
    return torch.tensor(columns, dtype=torch.float64).T.reshape(count, len(functions))


def total_reward(per_function: torch.Tensor, functions: list[RewardFunction]) -> torch.Tensor:
    """(N,) weighted sum over the functions that gave a reward (NaN counts as none); NaN where none did
    (TRL: an unscored completion is left out of its group's statistics and gets advantage 0)."""
    weights = torch.tensor([f.weight for f in functions], dtype=torch.float64)
    total = torch.nansum(per_function * weights, dim=1)
    return torch.where(per_function.isnan().all(dim=1), torch.nan, total)


def reward_metrics(per_function: torch.Tensor, functions: list[RewardFunction]) -> dict[str, float]:
    """`rewards/<name>/{mean,std}` over the completions each function scored, and how many it left out."""
    metrics = {}
    for column, reward in zip(per_function.T, functions):
        scored = column[~column.isnan()]
        metrics[f"rewards/{reward.name}/mean"] = float(scored.mean()) if scored.numel() else math.nan
        metrics[f"rewards/{reward.name}/std"] = float(scored.std()) if scored.numel() > 1 else 0.0
        metrics[f"rewards/{reward.name}/none_count"] = float(column.isnan().sum())
    return metrics
