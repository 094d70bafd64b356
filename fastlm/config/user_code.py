"""User code that a config names (`rl.rewards: [{function: "my_rewards:exact"}]`, `rl.environment: {name:
"my_envs:Game"}`), imported where users expect it.

`python train.py` finds modules next to the script; a `fastlm train my/run.yaml` user expects the same of
the modules the YAML names: they are imported with the folder of the config file that named them, the
folder of the config given on the command line, and the working directory on `sys.path` (ahead of the rest,
and kept there, so a module that imports its neighbours later still finds them). A section that names user
code derives from `UserCodeConfig`; the loader records the folders on it after validation.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from pydantic import BaseModel, PrivateAttr

from fastlm.config.base import ConfigModel
from fastlm.config.errors import ConfigIssue


class UserCodeConfig(ConfigModel):
    """A config section that names a user module; `import_module` looks where its config file lives."""

    _folders: tuple[str, ...] = PrivateAttr(default=())

    @property
    def search_folders(self) -> list[str]:
        """Where its modules are looked for before the rest of `sys.path`: the config files' folders, then the
        working directory."""
        return list(dict.fromkeys([*self._folders, str(Path.cwd())]))

    def set_folders(self, folders: Sequence[str | Path]) -> None:
        self._folders = tuple(str(Path(folder).resolve()) for folder in folders)

    def import_module(self, name: str) -> ModuleType:
        """`importlib.import_module(name)` with `search_folders` on `sys.path`."""
        added = [folder for folder in self.search_folders if folder not in sys.path]
        if added:
            sys.path[:0] = added
            importlib.invalidate_caches()
        return importlib.import_module(name)

    def import_issue(self, where: str, name: str, value: str, error: BaseException) -> ConfigIssue:
        """The problem of a module `import_module` could not import: why, and where it was looked for."""
        return ConfigIssue(where, f"cannot import module '{name}': {type(error).__name__}: {error}", value,
                           hint=f"looked in {', '.join(self.search_folders)} and PYTHONPATH; put the module next to "
                                "the config file or in the working directory")


def user_code_sections(node: Any, path: str = "") -> Iterator[tuple[str, UserCodeConfig]]:
    """Every `UserCodeConfig` in a config tree, with its dotted path (`rl.rewards[0]`)."""
    if isinstance(node, UserCodeConfig):
        yield path, node
    if isinstance(node, BaseModel):
        for name in type(node).model_fields:
            yield from user_code_sections(getattr(node, name), f"{path}.{name}".strip("."))
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from user_code_sections(value, f"{path}.{key}")
    elif isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            yield from user_code_sections(value, f"{path}[{index}]")
