"""The `rl.environment:` section: which environment runs the episodes, and its turn cap."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from fastlm.config.user_code import UserCodeConfig

BUILT_IN = "tool_arithmetic"


class EnvironmentConfig(UserCodeConfig):
    """Multi-turn episodes: the built-in calculator task, or a user class given as "package.module:Class"
    (constructed once per episode with `options` as keyword arguments; fastlm/rl/environments/base.py), its
    module found next to the config file as reward modules are (fastlm/config/user_code.py)."""

    name: str = Field(BUILT_IN, pattern=rf"^({BUILT_IN}|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$",
                      description=f'"{BUILT_IN}" (built-in) or "package.module:Class".')
    max_turns: int = Field(4, ge=1, le=64, description="Policy turns per episode at most.")
    options: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the environment class.")
