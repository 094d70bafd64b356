"""The root of a run's configuration: one typed object resolved from defaults, YAML and overrides."""

from __future__ import annotations

from pydantic import Field

from fastlm.config.base import ConfigModel
from fastlm.data.config import DataConfig
from fastlm.engine.config import DistributedConfig, OptimizerConfig, RunSection, ScheduleConfig, TrainerConfig
from fastlm.logging.config import LoggingConfig
from fastlm.models.config import LlamaConfig, ModelConfig


class RunConfig(ConfigModel):
    run: RunSection = Field(default_factory=RunSection)
    model: ModelConfig = Field(default_factory=LlamaConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
