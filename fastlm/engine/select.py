"""Which trainer a run needs, from its config (pretraining/SFT, RL, distillation, DPO)."""

from __future__ import annotations

from fastlm.config.schema import RunConfig
from fastlm.engine.trainer import Trainer


def trainer_class_for(config: RunConfig) -> type[Trainer]:
    return Trainer
