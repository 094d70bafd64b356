"""OLMo 2 <-> Hugging Face `olmo2`: Llama names with `post_attention_layernorm` / `post_feedforward_layernorm`
after attention and MLP (no input norm) and full-width `self_attn.q_norm` / `k_norm`."""

from __future__ import annotations

from typing import Any, ClassVar

from fastlm.config.errors import ConfigIssue
from fastlm.models.hf_adapter import Reader, WeightRule, rope_fields, rope_parameters
from fastlm.models.llama.hf import (
    COMMON_DEFAULTS,
    LLAMA_LIKE_FIELDS,
    SILU_ACTIVATIONS,
    LlamaAdapter,
    llama_like_to_hf,
    split_rules,
)
from fastlm.models.olmo2.config import Olmo2Config

OLMO2_DEFAULTS = {**COMMON_DEFAULTS, "num_key_value_heads": None, "max_position_embeddings": 2048,
                  "rms_norm_eps": 1e-5, "attention_bias": False, "rope_theta": 10_000.0}


class Olmo2Adapter(LlamaAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("olmo2",)
    defaults: ClassVar[dict[str, dict[str, Any]]] = {"olmo2": OLMO2_DEFAULTS}
    architecture_name: ClassVar[str] = "Olmo2ForCausalLM"

    def fields(self, reader: Reader, model_type: str) -> dict[str, Any]:
        fields = reader.fields(LLAMA_LIKE_FIELDS)
        reader.expect("attention_dropout", (0, 0.0), "model.dropout would also drop residual branches")
        fields.update(self.rope(reader, fields["max_seq_len"]))
        reader.expect("hidden_act", SILU_ACTIVATIONS, "the MLP is SwiGLU")
        reader.expect("attention_bias", (False,), "OLMo 2 here has no projection biases")
        hidden, heads = fields["hidden_size"], fields["num_heads"]
        if reader.hf.get("head_dim") is None and isinstance(hidden, int) and isinstance(heads, int) and heads:
            fields["head_dim"] = hidden // heads  # OLMo derives it
        return {"type": model_type, **fields, "sliding_window": None, "layer_types": None, "dropout": 0.0}

    def rope(self, reader: Reader, max_positions: Any) -> dict[str, Any]:
        """Our RoPE fields: one RoPE for every layer."""
        theta, scaling = rope_fields(reader, *rope_parameters(reader), max_positions)
        return {"rope_theta": theta, "rope_scaling": scaling}

    def export_issues(self, config: Olmo2Config) -> list[ConfigIssue]:  # type: ignore[override]
        issues = []
        if config.dropout:
            issues.append(ConfigIssue("model.dropout", "HF OLMo has attention dropout only", config.dropout,
                                      hint="set model.dropout: 0.0"))
        if config.qkv_bias:
            issues.append(ConfigIssue("model.qkv_bias", "HF OLMo has q/k/v/o biases together or none", True))
        if config.head_dim != config.hidden_size // config.num_heads:
            issues.append(ConfigIssue("model.head_dim", "HF OLMo's head_dim is hidden_size / num_heads", config.head_dim))
        return issues

    def to_hf(self, config: Olmo2Config) -> dict[str, Any]:  # type: ignore[override]
        hf = llama_like_to_hf(config)
        hf.pop("head_dim")
        return {"model_type": config.type, "architectures": [self.architecture_name], **hf, "attention_bias": False}

    def layer_rules(self, config: Olmo2Config, layer: int, base: str, hf: str) -> list[WeightRule]:  # type: ignore[override]
        names = (("post_attn_norm", "post_attention_layernorm"), ("post_mlp_norm", "post_feedforward_layernorm"),
                 ("attn.q_norm", "self_attn.q_norm"), ("attn.k_norm", "self_attn.k_norm"))
        return [*(WeightRule(f"{base}.{ours}.weight", (f"{hf}.{theirs}.weight",)) for ours, theirs in names),
                *split_rules(config, layer, base, hf)]
