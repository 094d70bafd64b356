"""Which trainer a run needs, from its config (pretraining/SFT, RL, distillation, DPO)."""

from __future__ import annotations

from fastlm.engine.distill import DistillationTrainer
from fastlm.engine.dpo import DPOTrainer
from fastlm.engine.trainer import Trainer
from fastlm.run_config.schema import RunConfig


def trainer_class_for(config: RunConfig) -> type[Trainer]:
    """RLTrainer for online RL (`rl:` set) or offline RL data; DPOTrainer for a dpo head; DistillationTrainer
    for a distillation child with a teacher_path; the plain Trainer otherwise."""
    if config.rl is not None or config.data.source.type == "offline_rl":
        from fastlm.rl.trainer import RLTrainer  # lazy: the RL stack is only needed by RL runs

        return RLTrainer
    if config.model.head.is_dpo:
        return DPOTrainer
    distill = config.model.head.child_of_type("distillation")
    if distill is not None and distill[1].teacher_path is not None:
        return DistillationTrainer
    return Trainer
