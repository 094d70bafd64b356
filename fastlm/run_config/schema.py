"""The root of a run's configuration: one typed object resolved from defaults, YAML and overrides."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from fastlm.config.base import ConfigModel
from fastlm.data.config import DataConfig
from fastlm.engine.config import DistributedConfig, OptimizerConfig, RunSection, ScheduleConfig, TrainerConfig
from fastlm.logging.config import LoggingConfig
from fastlm.models.config import DEFAULT_FAMILY, ModelConfig
from fastlm.models.registry import FAMILIES
from fastlm.rl.config import RLConfig


class RunConfig(ConfigModel):
    run: RunSection = Field(default_factory=RunSection)
    model: ModelConfig = Field(default_factory=FAMILIES[DEFAULT_FAMILY].config)  # type: ignore[arg-type]
    data: DataConfig = Field(default_factory=DataConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    rl: RLConfig | None = Field(None, description="Set for online GRPO/GSPO on a verifiable task (see configs/grpo.yaml).")

    @model_validator(mode="before")
    @classmethod
    def _default_variants(cls, data: Any) -> Any:
        """A section given without `type:` means the default variant (llama model, generated data)."""
        if isinstance(data, dict):
            data = dict(data)
            for section, key, default in (("model", None, DEFAULT_FAMILY), ("data", "source", "generated")):
                node = data.get(section)
                if key is not None:
                    parent = node if isinstance(node, dict) else None
                    node = parent.get(key) if parent else None
                if isinstance(node, dict) and "type" not in node:
                    filled = {"type": default, **node}
                    if key is None:
                        data[section] = filled
                    else:
                        data[section] = {**parent, key: filled}
        return data
