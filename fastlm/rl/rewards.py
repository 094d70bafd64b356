"""Rewards as user code (TRL's reward-function convention).

`rl.rewards: [{function: "package.module:name", weight: 1.0}]`. A function is called once per rollout with
keyword arguments, one list entry per completion (prompt-major, G per prompt):

    prompts: list[str], completions: list[str], completion_ids: list[list[int]], stopped: list[bool],
    plus every extra column of the prompt records (e.g. `answer`), repeated for the G completions,

and returns one float (or None: "no reward from this function") per completion; accept `**kwargs` for
columns you do not use. The argument names above are reserved: a prompt column with one of them is refused
when the prompts are loaded (fastlm/rl/prompts.py). Each function gets its own deep copies of the lists, so
one that edits them changes nothing for the next. The total reward is the weighted sum over the functions
that gave one; a completion none scored is left out of its group's mean and std and gets advantage 0 (TRL).

A function that raises, returns the wrong count or a non-number stops the run with a `RewardError` naming
the function and the prompt index; a NaN does too, or counts as None with `rl.nan_rewards: skip`; so does a
value that is not finite as a float (10**400) or once weighted. User functions run in a child process
(fastlm/rl/user_code.py: a thread cannot stop code that holds the GIL), which the run waits for at most
`rl.reward_timeout_s` seconds per call, and only until a SIGTERM/SIGINT arrives: either way the process is
killed and the run stops with a `RewardError` (the RL trainer then writes the checkpoint of the last
finished step, as for a raising function). Each call gets the lists as the child unpickles them (its own
copies); built-in rewards run in this process.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fastlm.config.errors import ConfigError, ConfigIssue
from fastlm.rl.config import RewardConfig
from fastlm.rl.user_code import Opaque, UserCodeAbandoned, UserCodeError, UserCodeProcess

RewardCallable = Callable[..., Sequence[float | None]]
RESERVED_ARGUMENTS = ("prompts", "completions", "completion_ids", "stopped")
DEFAULT_TIMEOUT_S = 60.0


class RewardError(RuntimeError):
    """A reward function failed; the message names it and the prompt index (no traceback for the user)."""


@dataclass(frozen=True)
class RewardFunction:
    name: str  # metric name: train/rewards/<name>/{mean,std}
    path: str  # "package.module:name", for messages
    function: RewardCallable
    weight: float
    timeout_s: float = DEFAULT_TIMEOUT_S  # rl.reward_timeout_s
    process: UserCodeProcess | None = None  # where user code runs (killable); None: here (a built-in reward)


def load_reward_functions(configs: list[RewardConfig], timeout_s: float = DEFAULT_TIMEOUT_S) -> list[RewardFunction]:
    """Import every configured function; a bad path is a `ConfigError` at `rl.rewards[i].function`."""
    functions, issues, process = [], [], UserCodeProcess()
    for index, config in enumerate(configs):
        where = f"rl.rewards[{index}].function"
        module_name, attribute = config.function.split(":")
        try:
            module = config.import_module(module_name)
        except Exception as error:  # noqa: BLE001 - any import failure of user code is a config problem
            issues.append(config.import_issue(where, module_name, config.function, error))
            continue
        function = getattr(module, attribute, None)
        if not callable(function):
            issues.append(ConfigIssue(where, f"module '{module_name}' has no function '{attribute}'", config.function))
            continue
        functions.append(RewardFunction(config.metric_name, config.function, function, config.weight, timeout_s,
                                        process))
    names = [f.name for f in functions]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        issues.append(ConfigIssue("rl.rewards", f"two reward functions share the metric name(s) {duplicates}",
                                  names, hint="give each a distinct `name:`"))
    if issues:
        raise ConfigError(issues)
    return functions


def shown(value: Any) -> str:
    """A returned value for a message: its type and repr, cut at 80 characters (a repr that fails, such as
    an int past Python's digit limit, by its type)."""
    if isinstance(value, Opaque):
        return repr(value)
    try:
        return f"{type(value).__name__} {repr(value)[:80]}"
    except ValueError:
        return f"an {type(value).__name__} too long to print"


def as_reward(value: Any) -> float | None:
    """A returned reward as a float (None stays None); a `ValueError` saying what came instead of a number:
    a non-number, a bool, or an integer past the float range (10**400 is not a reward, not a traceback)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"returned {shown(value)}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"returned an integer of {value.bit_length()} bits, past the float range") from None


def _bounded(reward: RewardFunction, arguments: dict[str, list[Any]]) -> list[Any]:
    """The function's values: a user function's from its process (killed past its timeout or at a stop
    signal: a `RewardError`; its own exception a `UserCodeError`), a built-in's called here on deep copies."""
    if reward.process is None:
        return list(reward.function(**copy.deepcopy(arguments)))
    try:
        values = reward.process.call("call", reward.path, arguments, timeout_s=reward.timeout_s)
    except UserCodeAbandoned as error:
        raise RewardError(f"reward function '{reward.name}' ({reward.path}) {error}; it was abandoned (make it "
                          "return sooner, or raise rl.reward_timeout_s)") from error
    if not isinstance(values, list):
        raise RewardError(f"reward function '{reward.name}' ({reward.path}) returned {shown(values)}; return a "
                          "list of one float or None per completion")
    return values


def _call(reward: RewardFunction, arguments: dict[str, list[Any]], group_size: int) -> list[Any]:
    """The function's values; on an exception, locate the first completion that raises (one at a time)."""
    try:
        return _bounded(reward, arguments)
    except RewardError:
        raise
    except Exception as error:  # noqa: BLE001 - user code: report which prompt, with the original error
        failing = "?"
        for index in range(len(arguments["completions"])):
            try:
                _bounded(reward, {key: values[index : index + 1] for key, values in arguments.items()})
            except RewardError:
                break
            except Exception:  # noqa: BLE001
                failing = str(index // group_size)
                break
        said = str(error) if isinstance(error, UserCodeError) else f"raised {type(error).__name__}: {error}"
        raise RewardError(f"reward function '{reward.name}' ({reward.path}) {said} (prompt index {failing} of "
                          "this rollout)") from error


def _value(reward: RewardFunction, value: Any, index: int, group_size: int, nan_policy: str) -> float:
    """One returned value as a float (NaN = no reward), or a RewardError naming the prompt."""
    where = f"reward function '{reward.name}' ({reward.path}), prompt index {index // group_size} (completion {index})"
    try:
        number = as_reward(value)
    except ValueError as error:
        raise RewardError(f"{where}: {error}, expected a float or None") from None
    if number is None:
        return math.nan
    if math.isinf(number) or (math.isnan(number) and nan_policy == "error"):
        raise RewardError(f"{where}: returned {number}; return a finite float or None "
                          "(or set rl.nan_rewards: skip to count NaN as no reward)")
    return number


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
    """(N,) weighted sum over the functions that gave a reward (NaN counts as none); NaN where none did (TRL:
    an unscored completion is left out of its group's statistics and gets advantage 0). A weighted value or a
    sum that overflows to infinity is a `RewardError` naming the function."""
    weights = torch.tensor([f.weight for f in functions], dtype=torch.float64)
    weighted = per_function * weights
    overflow = torch.isinf(weighted)
    if overflow.any():
        row, column = (int(i) for i in overflow.nonzero()[0])
        reward = functions[column]
        raise RewardError(f"reward function '{reward.name}' ({reward.path}), completion {row}: its value "
                          f"{float(per_function[row, column]):g} x weight {reward.weight:g} is not a finite number; "
                          "return smaller rewards or lower its weight")
    total = torch.nansum(weighted, dim=1)
    if torch.isinf(total).any():
        row = int(torch.isinf(total).nonzero()[0])
        raise RewardError(f"the weighted rewards of completion {row} sum to {float(total[row]):g} (functions "
                          f"{[f.name for f in functions]}); return smaller rewards or lower the weights")
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
