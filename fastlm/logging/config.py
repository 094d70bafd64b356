"""Where scalars go: wandb (offline unless a key is set), a local JSONL, and a progress line."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fastlm.config.base import ConfigModel


class WandbConfig(ConfigModel):
    enabled: bool = True
    project: str = "fastlm"
    name: str | None = Field(None, description="Defaults to run.name.")
    tags: list[str] = Field(default_factory=list)
    group: str | None = None
    mode: Literal["auto", "online", "offline", "disabled"] = Field(
        "auto", description="auto: WANDB_MODE if set, else online with an API key, else offline."
    )


class LoggingConfig(ConfigModel):
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    jsonl: bool = True
    progress: bool = True
