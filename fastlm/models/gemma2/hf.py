"""Gemma 2 <-> Hugging Face `gemma2`: Gemma 3's layout without q_norm / k_norm (input, post_attention,
pre_feedforward and post_feedforward norms; q/k/v/o and gate/up/down projections), one RoPE for every
layer, `attn_logit_softcapping` on the attention scores and `final_logit_softcapping` on the logits
(the head's softcap). Older files without `layer_types` alternate sliding and global layers."""

from __future__ import annotations

from typing import Any, ClassVar

from fastlm.config.errors import ConfigIssue
from fastlm.models.gemma2.config import SLIDING_EVERY, Gemma2Config
from fastlm.models.hf_adapter import FULL, SLIDING, Reader, WeightRule, plausible_layers
from fastlm.models.llama.hf import (
    COMMON_DEFAULTS,
    LlamaAdapter,
    layer_types_to_hf,
    llama_like_fields,
    llama_like_to_hf,
    split_rules,
    window_fields,
)

_DEFAULTS = {
    **COMMON_DEFAULTS, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192, "tie_word_embeddings": True, "attention_bias": False,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "layer_types": None, "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0, "use_bidirectional_attention": None, "rope_theta": 10_000.0}
SANDWICH_NORMS = (("attn_norm", "input_layernorm"), ("post_attn_norm", "post_attention_layernorm"),
                  ("mlp_norm", "pre_feedforward_layernorm"), ("post_mlp_norm", "post_feedforward_layernorm"))


class Gemma2Adapter(LlamaAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("gemma2",)
    defaults: ClassVar[dict[str, dict[str, Any]]] = {"gemma2": _DEFAULTS}

    def fields(self, reader: Reader, model_type: str) -> dict[str, Any]:
        fields = llama_like_fields(reader)
        fields["query_pre_attn_scalar"] = reader.get("query_pre_attn_scalar")
        fields["attn_logit_softcap"] = reader.get("attn_logit_softcapping")
        fields["final_logit_softcap"] = reader.get("final_logit_softcapping")
        reader.expect("hidden_activation", ("gelu_pytorch_tanh", "gelu_tanh"), "the MLP is GeGLU with the tanh GELU")
        reader.expect("attention_bias", (False,), "Gemma 2 has no projection biases")
        reader.expect("use_bidirectional_attention", (False, None), "decoder-only, causal attention")
        num_layers = fields["num_layers"]
        derived = reader
        if reader.hf.get("layer_types") is None and plausible_layers(reader, num_layers):  # HF's default pattern
            kinds = [SLIDING if (i + 1) % SLIDING_EVERY else FULL for i in range(num_layers)]
            derived = Reader({**reader.hf, "layer_types": kinds}, reader.defaults, reader.source)
        windows = window_fields(derived, reader.get("sliding_window"), num_layers)
        if derived is not reader:
            reader.issues += derived.issues
        if windows["layer_types"] is None and windows["sliding_window"] is not None and not reader.issues:  # all local
            windows["layer_types"] = [SLIDING] * num_layers
        return {"type": "gemma2", **fields, **windows}

    def export_issues(self, config: Gemma2Config) -> list[ConfigIssue]:  # type: ignore[override]
        issues = [ConfigIssue("model.dropout", "HF Gemma 2 has attention dropout only", config.dropout,
                              hint="set model.dropout: 0.0")] if config.dropout else []
        if config.qkv_bias:
            issues.append(ConfigIssue("model.qkv_bias", "HF Gemma 2 has q/k/v/o biases together or none", True))
        return issues

    def to_hf(self, config: Gemma2Config) -> dict[str, Any]:  # type: ignore[override]
        hf = llama_like_to_hf(config)
        hf.pop("hidden_act")
        return {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], **hf,
                "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
                "query_pre_attn_scalar": config.query_pre_attn_scalar or config.head_dim,
                "sliding_window": config.sliding_window or 4096, "layer_types": layer_types_to_hf(config),
                "final_logit_softcapping": config.final_logit_softcap,
                "attn_logit_softcapping": config.attn_logit_softcap}

    def layer_rules(self, config: Gemma2Config, layer: int, base: str, hf: str) -> list[WeightRule]:  # type: ignore[override]
        return [*(WeightRule(f"{base}.{ours}.weight", (f"{hf}.{theirs}.weight",)) for ours, theirs in SANDWICH_NORMS),
                *split_rules(config, layer, base, hf)]
