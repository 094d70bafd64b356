"""Qwen3 <-> Hugging Face `qwen3`: the Llama layout plus self_attn.q_norm / k_norm; windows as Qwen2's
(`use_sliding_window`, `max_window_layers`, `layer_types`)."""

from __future__ import annotations

from typing import Any, ClassVar

from fastlm.config.errors import ConfigIssue
from fastlm.models.hf_adapter import Reader, WeightRule
from fastlm.models.llama.hf import (
    COMMON_DEFAULTS,
    SILU_ACTIVATIONS,
    LlamaAdapter,
    layer_types_to_hf,
    llama_like_fields,
    llama_like_to_hf,
    window_fields,
)
from fastlm.models.qwen3.config import Qwen3Config


class Qwen3Adapter(LlamaAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("qwen3",)
    defaults: ClassVar[dict[str, dict[str, Any]]] = {"qwen3": {
        **COMMON_DEFAULTS, "num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768,
        "attention_bias": False, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
        "layer_types": None}}

    def fields(self, reader: Reader, model_type: str) -> dict[str, Any]:
        fields = llama_like_fields(reader)
        reader.expect("hidden_act", SILU_ACTIVATIONS, "the MLP is SwiGLU")
        reader.expect("attention_bias", (False,), "Qwen3 here has no q/k/v/o biases")
        window = reader.get("sliding_window") if reader.get("use_sliding_window") else None
        windows = window_fields(reader, window, fields["num_layers"], reader.get("max_window_layers"))
        return {"type": "qwen3", **fields, **windows}

    def export_issues(self, config: Qwen3Config) -> list[ConfigIssue]:  # type: ignore[override]
        if config.dropout:
            return [ConfigIssue("model.dropout", "HF Qwen3 has attention dropout only", config.dropout,
                                hint="set model.dropout: 0.0")]
        return []

    def to_hf(self, config: Qwen3Config) -> dict[str, Any]:  # type: ignore[override]
        window = config.sliding_window
        return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **llama_like_to_hf(config),
                "attention_bias": False, "use_sliding_window": window is not None, "sliding_window": window,
                "max_window_layers": config.num_layers if window is None else 0,
                "layer_types": layer_types_to_hf(config)}

    def layer_rules(self, config: Qwen3Config, layer: int, base: str, hf: str) -> list[WeightRule]:  # type: ignore[override]
        return [*super().layer_rules(config, layer, base, hf),
                WeightRule(f"{base}.attn.q_norm.weight", (f"{hf}.self_attn.q_norm.weight",)),
                WeightRule(f"{base}.attn.k_norm.weight", (f"{hf}.self_attn.k_norm.weight",))]
