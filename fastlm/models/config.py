"""The model section of a run config: `ModelConfig`, the union of every registered family's config,
discriminated by `type:` (fastlm/models/registry.py lists the families)."""

from __future__ import annotations

from fastlm.models.base import DecoderConfig
from fastlm.models.gpt2.config import GPT2Config
from fastlm.models.llama.config import LlamaConfig
from fastlm.models.registry import DEFAULT_FAMILY, ModelConfig

__all__ = ["DEFAULT_FAMILY", "DecoderConfig", "GPT2Config", "LlamaConfig", "ModelConfig"]
