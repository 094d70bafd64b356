"""Granite <-> Hugging Face `granite`: the Llama layout and names, plus `embedding_multiplier`,
`residual_multiplier`, `attention_multiplier` and `logits_scaling` (head_dim = hidden / heads).

The published Granite 3.x configs set `attention_dropout: 0.1`, a regulariser transformers applies in
training mode only: the import keeps the weights and logits exact and trains without it (fastlm's one
`model.dropout` would also drop the residual branches), and the export writes 0.0."""

from __future__ import annotations

from typing import Any, ClassVar

from fastlm.config.errors import ConfigIssue
from fastlm.models.granite.config import GraniteConfig
from fastlm.models.hf_adapter import Reader
from fastlm.models.llama.hf import COMMON_DEFAULTS, SILU_ACTIVATIONS, LlamaAdapter, llama_like_fields, llama_like_to_hf

MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


class GraniteAdapter(LlamaAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("granite",)
    defaults: ClassVar[dict[str, dict[str, Any]]] = {"granite": {
        **COMMON_DEFAULTS, "num_key_value_heads": None, "max_position_embeddings": 2048, "attention_bias": False,
        "mlp_bias": False, **dict.fromkeys(MULTIPLIERS, 1.0)}}

    def fields(self, reader: Reader, model_type: str) -> dict[str, Any]:
        dropout = reader.get("attention_dropout")
        if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            reader.fail("attention_dropout", "must be a number in [0, 1)", dropout)
        inference = Reader({**reader.hf, "attention_dropout": 0.0}, reader.defaults, reader.source)  # see above
        fields = llama_like_fields(inference)
        reader.issues += inference.issues
        reader.expect("hidden_act", SILU_ACTIVATIONS, "the MLP is SwiGLU")
        reader.expect("attention_bias", (False,), "Granite here has no projection biases")
        reader.expect("mlp_bias", (False,), "the SwiGLU MLP has no biases")
        hidden, heads = fields["hidden_size"], fields["num_heads"]
        if isinstance(hidden, int) and isinstance(heads, int) and heads:
            fields["head_dim"] = hidden // heads  # transformers' Granite derives it (a head_dim key is ignored)
        return {"type": "granite", **fields, **reader.fields({name: name for name in MULTIPLIERS}),
                "sliding_window": None, "layer_types": None}

    def export_issues(self, config: GraniteConfig) -> list[ConfigIssue]:  # type: ignore[override]
        issues = []
        if config.dropout:
            issues.append(ConfigIssue("model.dropout", "HF Granite has attention dropout only", config.dropout,
                                      hint="set model.dropout: 0.0"))
        if config.qkv_bias or config.sliding_window is not None:
            issues.append(ConfigIssue("model", "HF Granite has no q/k/v-only biases or sliding window", None,
                                      hint="set qkv_bias: false, sliding_window: null"))
        if config.head_dim != config.hidden_size // config.num_heads:
            issues.append(ConfigIssue("model.head_dim", "HF Granite's head_dim is hidden_size / num_heads",
                                      config.head_dim))
        return issues

    def to_hf(self, config: GraniteConfig) -> dict[str, Any]:  # type: ignore[override]
        hf = llama_like_to_hf(config)
        hf.pop("head_dim")
        return {"model_type": "granite", "architectures": ["GraniteForCausalLM"], **hf, "attention_bias": False,
                "mlp_bias": False, **{name: getattr(config, name) for name in MULTIPLIERS}}
