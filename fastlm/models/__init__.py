"""Model zoo: one package per family (fastlm/models/registry.py lists them), `ModelConfig` (their union),
`DecoderLM`, `build_model` and sizing helpers.

Exports are resolved on first access (PEP 562) so that importing the config schema, which imports
`fastlm.models.config`, does not pull in torch and the layer stack.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS: dict[str, str] = {
    "GPT2Config": "fastlm.models.config",
    "LlamaConfig": "fastlm.models.config",
    "ModelConfig": "fastlm.models.config",
    "DecoderLM": "fastlm.models.decoder",
    "DecoderBlock": "fastlm.layers.block",
    "build_model": "fastlm.models.decoder",
    "count_parameters": "fastlm.models.build",
    "num_parameters": "fastlm.models.build",
    "active_parameters": "fastlm.models.build",
    "model_flops_per_token": "fastlm.models.build",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fastlm.models' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
