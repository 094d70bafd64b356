"""Ministral <-> Hugging Face `ministral`: the Llama layout and names, `sliding_window` with `layer_types`
(every layer slides when the list is absent and a window is set)."""

from __future__ import annotations

from typing import Any, ClassVar

from fastlm.config.errors import ConfigIssue
from fastlm.models.hf_adapter import Reader
from fastlm.models.llama.hf import (
    COMMON_DEFAULTS,
    SILU_ACTIVATIONS,
    LlamaAdapter,
    layer_types_to_hf,
    llama_like_fields,
    llama_like_to_hf,
    window_fields,
)
from fastlm.models.ministral.config import MinistralConfig


class MinistralAdapter(LlamaAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("ministral",)
    defaults: ClassVar[dict[str, dict[str, Any]]] = {"ministral": {
        **COMMON_DEFAULTS, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32, "sliding_window": 4096,
        "layer_types": None}}

    def fields(self, reader: Reader, model_type: str) -> dict[str, Any]:
        fields = llama_like_fields(reader)
        reader.expect("hidden_act", SILU_ACTIVATIONS, "the MLP is SwiGLU")
        return {"type": model_type, **fields, **window_fields(reader, reader.get("sliding_window"), fields["num_layers"])}

    def export_issues(self, config: MinistralConfig) -> list[ConfigIssue]:  # type: ignore[override]
        if config.dropout:
            return [ConfigIssue("model.dropout", "HF Ministral has attention dropout only", config.dropout,
                                hint="set model.dropout: 0.0")]
        return []

    def to_hf(self, config: MinistralConfig) -> dict[str, Any]:  # type: ignore[override]
        return {"model_type": "ministral", "architectures": ["MinistralForCausalLM"], **llama_like_to_hf(config),
                "sliding_window": config.sliding_window, "layer_types": layer_types_to_hf(config)}
