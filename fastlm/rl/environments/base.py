"""The environment interface, and the checks that turn a user environment's mistakes into one clear error.

An environment runs one episode (a fresh instance per episode, so it may keep the episode's state):

    reset(record: PromptRecord) -> messages
        The conversation the policy answers first: a list of {"role", "content"} messages, rendered by the
        run tokenizer's chat template with the generation prompt.
    step(messages, completion) -> (new_messages | None, reward | None, info)
        Called after every policy turn that ended with a stop token; `messages` is the conversation so far,
        the policy's turn last (role "assistant", content `completion`). `new_messages` (e.g. "tool"
        results) are appended and the policy takes another turn; None ends the episode. The episode's
        reward is the sum of the rewards returned (None counts as 0). `info` is a dict; its numbers
        "tool_calls" and "tool_errors" are summed into the rollout metrics.

An episode also ends after `rl.environment.max_turns` policy turns, on a turn that hits max_new_tokens
without a stop token or cut at the episode's token budget (not passed to `step`, as a single-turn
completion without a stop scores 0), or when an environment reply leaves no room for another turn. A class may also
offer `task` (a built-in `Task` that supplies the prompts and the greedy eval) and `demonstrations(count, noise, seed)`
(conversations for the supervised warm-up).

A user class's instances live in a child process (fastlm/rl/user_code.py), as reward functions do: each call
(constructor, reset, step) is waited for at most `rl.reward_timeout_s` and only until a SIGTERM/SIGINT, then
the process is killed. Anything an environment raises, returns wrongly or does not return in time is an
`EnvironmentFailure` (a `RewardError`): the trainer saves a checkpoint of the last finished step and stops
with the class, the method and the prompt index.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastlm.config.errors import ConfigError, ConfigIssue
from fastlm.data.chat import ChatError, check_messages
from fastlm.data.tokenizer import Message
from fastlm.rl.environments.config import BUILT_IN, EnvironmentConfig
from fastlm.rl.prompts import PromptRecord
from fastlm.rl.rewards import DEFAULT_TIMEOUT_S, RewardError, as_reward, shown
from fastlm.rl.user_code import UserCodeAbandoned, UserCodeError, UserCodeProcess

StepOutput = tuple[list[Message] | None, float | None, dict[str, Any]]


class Environment(Protocol):
    def reset(self, record: PromptRecord) -> list[Message]: ...

    def step(self, messages: list[Message], completion: str) -> StepOutput: ...


class EnvironmentFailure(RewardError):
    """A user environment raised or returned something invalid; the message names it and the prompt index."""


@dataclass(frozen=True)
class EnvironmentFactory:
    """Builds one environment per episode and calls it, turning its failures into `EnvironmentFailure`s. A
    user class's episodes live in a child process (fastlm/rl/user_code.py), each call waited for at most
    `timeout_s` (rl.reward_timeout_s) and only until a stop signal, as reward functions are; the built-in's
    run here."""

    path: str  # "package.module:Class" or the built-in's name, for messages
    make: Callable[[], Any]  # one instance, here
    max_turns: int
    prototype: Any  # one instance built at load time: its optional `task` and `demonstrations`
    process: UserCodeProcess | None = None  # where a user class's episodes run (killable); None: here
    options: dict[str, Any] = field(default_factory=dict)  # the user class's keyword arguments
    timeout_s: float = DEFAULT_TIMEOUT_S

    def _failed(self, method: str, index: int | None, what: str) -> EnvironmentFailure:
        where = "" if index is None else f" (prompt index {index} of this rollout)"
        return EnvironmentFailure(f"environment '{self.path}' {method} {what}{where}")

    def _run(self, method: str, index: int | None, here: Callable[[], Any], *request: Any) -> Any:
        """`here()` in this process, or `request` in the user-code process; any failure an EnvironmentFailure."""
        try:
            return here() if self.process is None else self.process.call(*request, timeout_s=self.timeout_s)
        except UserCodeAbandoned as error:
            raise self._failed(method, index, f"{error}; it was abandoned (make it return sooner, or raise "
                               "rl.reward_timeout_s)") from error
        except UserCodeError as error:
            raise self._failed(method, index, str(error)) from error
        except Exception as error:
            raise self._failed(method, index, f"raised {type(error).__name__}: {error}") from error

    def new(self, index: int) -> Any:
        """An environment, or its handle in the user-code process."""
        return self._run("constructor", index, self.make, "create", self.path, self.options)

    def release(self, environments: list[Any]) -> None:
        """Forget a rollout's environments (in the user-code process: drop its instances)."""
        if self.process is not None:
            self._run("release", None, lambda: None, "drop", environments)

    def reset(self, environment: Any, record: PromptRecord, index: int) -> list[Message]:
        messages = self._run("reset", index, lambda: environment.reset(record), "method", environment, "reset",
                             (record,))
        try:
            return check_messages(messages)
        except ChatError as error:
            raise self._failed("reset", index, f"returned bad messages: {error}") from error

    def step(self, environment: Any, messages: list[Message], completion: str, index: int) -> StepOutput:
        copies = [dict(m) for m in messages]
        output = self._run("step", index, lambda: environment.step(copies, completion), "method", environment,
                           "step", (copies, completion))
        if not isinstance(output, (tuple, list)) or len(output) != 3:
            raise self._failed("step", index, f"returned {shown(output)}; return "
                               "(new_messages or None, reward or None, info dict)")
        new_messages, reward, info = output
        if new_messages is not None:
            try:
                new_messages = check_messages(new_messages)
            except ChatError as error:
                raise self._failed("step", index, f"returned bad new messages: {error}") from error
        try:
            reward = as_reward(reward)
        except ValueError as error:
            raise self._failed("step", index, f"{error} as the reward; return a finite float or None") from None
        if reward is not None and not math.isfinite(reward):
            raise self._failed("step", index, f"returned the reward {reward!r}; return a finite float or None")
        if info is None:
            info = {}
        if not isinstance(info, dict):
            raise self._failed("step", index, f"returned info of type {type(info).__name__}; return a dict")
        return new_messages, reward, info


def load_environment(config: EnvironmentConfig, format_reward: float,
                     timeout_s: float = DEFAULT_TIMEOUT_S) -> EnvironmentFactory:
    """The configured environment's factory; a bad class path or options is a `ConfigError` at rl.environment."""
    if config.name == BUILT_IN:
        from fastlm.rl.environments.arithmetic import (
            ToolArithmetic,
            ToolArithmeticOptions,
        )

        try:
            options = ToolArithmeticOptions(**config.options)
        except Exception as error:
            raise ConfigError(ConfigIssue("rl.environment.options", str(error).replace("\n", "; "),
                                          config.options)) from error

        def make() -> ToolArithmetic:
            return ToolArithmetic(options, format_reward)

        return EnvironmentFactory(config.name, make, config.max_turns, make())
    module_name, attribute = config.name.split(":")
    where = "rl.environment.name"
    try:
        module = config.import_module(module_name)
    except Exception as error:
        raise ConfigError(config.import_issue(where, module_name, config.name, error)) from error
    cls = getattr(module, attribute, None)
    if not callable(cls):
        raise ConfigError(ConfigIssue(where, f"module '{module_name}' has no class '{attribute}'", config.name))
    missing = [name for name in ("reset", "step") if not callable(getattr(cls, name, None))]
    if missing:
        raise ConfigError(ConfigIssue(where, f"'{config.name}' has no method(s) {missing}", config.name,
                                      hint="an environment defines reset(record) and step(messages, completion)"))
    try:
        prototype = cls(**config.options)
    except Exception as error:
        raise ConfigError(ConfigIssue("rl.environment.options", f"'{config.name}'({config.options}) raised "
                                      f"{type(error).__name__}: {error}", config.options)) from error
    return EnvironmentFactory(config.name, lambda: cls(**config.options), config.max_turns, prototype,
                              UserCodeProcess(), config.options, timeout_s)
