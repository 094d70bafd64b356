"""The one place that lists the model families (one line each). Everything else asks the registry:
the config schema (`ModelConfig`), the HF import (which family takes a config.json's model_type) and
every family-specific method through the config object."""

from __future__ import annotations

from importlib import import_module
from typing import Annotated, Union

from pydantic import Field

from fastlm.models.base import DecoderConfig
from fastlm.models.family import Family

FAMILY_PACKAGES = (
    "gpt2",
    "llama",
    "qwen3",
    "gemma3",
    "phi3",
    "mixtral",
    "olmoe",
    "qwen3_moe",
    "qwen3_5",
    "qwen2_moe",
    "gemma2",
    "olmo2",
    "olmo3",
    "granite",
    "smollm3",
    "glm4",
    "ministral",
    "ministral3",
    "gpt_oss",
    "deepseek_v3",
    "gemma4",
)
DEFAULT_FAMILY = "llama"  # the model section's `type:` when a config leaves it out

FAMILIES: dict[str, Family] = {}
for _package in FAMILY_PACKAGES:
    _family: Family = import_module(f"fastlm.models.{_package}").FAMILY
    FAMILIES[_family.name] = _family

ModelConfig = Annotated[Union[tuple(family.config for family in FAMILIES.values())],  # type: ignore[valid-type]  # noqa: UP007
                        Field(discriminator="type")]


def family_of(config: DecoderConfig) -> Family:
    return FAMILIES[config.type]  # type: ignore[attr-defined]


def family_for_model_type(model_type: object) -> Family | None:
    """The family whose HF adapter imports config.json's `model_type`, or None."""
    return next((family for family in FAMILIES.values() if model_type in family.hf.model_types), None)


def hf_model_types() -> list[str]:
    return [model_type for family in FAMILIES.values() for model_type in family.hf.model_types]
