"""SmolLM3 <-> Hugging Face `smollm3`: the Llama layout and names; `no_rope_layers` (1: RoPE, 0: none;
derived from `no_rope_layer_interval` when absent) and windows through `use_sliding_window`, `sliding_window`
and `layer_types`."""

from __future__ import annotations

from typing import Any, ClassVar

from fastlm.config.errors import ConfigIssue
from fastlm.models.hf_adapter import Reader, plausible_layers
from fastlm.models.llama.hf import (
    COMMON_DEFAULTS,
    SILU_ACTIVATIONS,
    LlamaAdapter,
    layer_types_to_hf,
    llama_like_fields,
    llama_like_to_hf,
    window_fields,
)
from fastlm.models.smollm3.config import SmolLM3Config


class SmolLM3Adapter(LlamaAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("smollm3",)
    defaults: ClassVar[dict[str, dict[str, Any]]] = {"smollm3": {
        **COMMON_DEFAULTS, "num_key_value_heads": 4, "max_position_embeddings": 32768, "rope_theta": 2_000_000.0,
        "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False, "use_sliding_window": False,
        "sliding_window": None, "no_rope_layers": None, "no_rope_layer_interval": 4, "layer_types": None}}

    def fields(self, reader: Reader, model_type: str) -> dict[str, Any]:
        fields = llama_like_fields(reader)
        reader.expect("hidden_act", SILU_ACTIVATIONS, "the MLP is SwiGLU")
        reader.expect("attention_bias", (False,), "SmolLM3 here has no projection biases")
        reader.expect("mlp_bias", (False,), "the SwiGLU MLP has no biases")
        num_layers = fields["num_layers"]
        window = reader.get("sliding_window") if reader.get("use_sliding_window") else None
        return {"type": "smollm3", **fields, **window_fields(reader, window, num_layers),
                "nope_layers": self._nope_layers(reader, num_layers)}

    @staticmethod
    def _nope_layers(reader: Reader, num_layers: Any) -> list[int] | None:
        flags = reader.get("no_rope_layers")
        if flags is None:
            interval = reader.get("no_rope_layer_interval")
            if not isinstance(interval, int) or interval < 1:
                reader.fail("no_rope_layer_interval", "must be a positive integer", interval)
                return None
            if not plausible_layers(reader, num_layers):
                return None
            flags = [int((layer + 1) % interval != 0) for layer in range(num_layers)]
        if not isinstance(flags, list) or not set(flags) <= {0, 1} or len(flags) != num_layers:
            reader.fail("no_rope_layers", f"must list 1 (RoPE) or 0 (none) for each of the {num_layers} layers", flags)
            return None
        return [layer for layer, flag in enumerate(flags) if not flag]

    def export_issues(self, config: SmolLM3Config) -> list[ConfigIssue]:  # type: ignore[override]
        issues = []
        if config.dropout:
            issues.append(ConfigIssue("model.dropout", "HF SmolLM3 has attention dropout only", config.dropout,
                                      hint="set model.dropout: 0.0"))
        if config.qkv_bias:
            issues.append(ConfigIssue("model.qkv_bias", "HF SmolLM3 has q/k/v/o biases together or none", True))
        return issues

    def to_hf(self, config: SmolLM3Config) -> dict[str, Any]:  # type: ignore[override]
        window = config.sliding_window
        return {"model_type": "smollm3", "architectures": ["SmolLM3ForCausalLM"], **llama_like_to_hf(config),
                "attention_bias": False, "mlp_bias": False, "use_sliding_window": window is not None,
                "sliding_window": window, "layer_types": layer_types_to_hf(config),
                "no_rope_layers": [int(config.has_rope(layer)) for layer in range(config.num_layers)]}
