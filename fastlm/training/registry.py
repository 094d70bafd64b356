"""Which objective trains a run: one registry line per training kind.

A new training kind is its objective file (an `Objective`, fastlm/engine/objective.py) plus one line in
`OBJECTIVES` and, if the config tells it apart, one case in `training_kind`. Objectives are imported when a run
needs them, so a supervised run never loads the RL stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from fastlm.engine.objective import Objective, TrainingParts
from fastlm.engine.trainer import Trainer

if TYPE_CHECKING:
    from collections.abc import Callable

    from fastlm.run_config.schema import RunConfig

OBJECTIVES: dict[str, str] = {  # kind -> "module:class"
    "supervised": "fastlm.engine.objective:SupervisedObjective",  # LM, SFT, DPO, distillation
    "offline_rl": "fastlm.rl.objective:PolicyObjective",
    "online_rl": "fastlm.rl.objective:OnlineRLObjective",
}


def training_kind(config: RunConfig) -> str:
    """Offline RL data, online RL (an `rl:` section), or supervised (the loss children say the rest)."""
    if config.data.source.type == "offline_rl":
        return "offline_rl"
    return "online_rl" if config.rl is not None else "supervised"


def objective_for(config: RunConfig) -> Callable[[TrainingParts], Objective]:
    module, name = OBJECTIVES[training_kind(config)].split(":")
    return getattr(importlib.import_module(module), name)


def build_trainer(config: RunConfig, rank: int | None = None) -> Trainer:
    """The trainer of this run, with its objective."""
    return Trainer(config, rank, objective_for(config))
