"""Gemma 3 (text) <-> Hugging Face `gemma3_text`: Llama-like q/k/v/o and gate/up/down projections,
four norms per layer (input, post_attention, pre_feedforward, post_feedforward), q_norm / k_norm, and
RoPE parameters per layer type (transformers 5 `rope_parameters` nested under full_attention /
sliding_attention, or the older rope_theta + rope_local_base_freq + rope_scaling).

A multimodal `gemma3` checkpoint (Gemma3ForConditionalGeneration) imports as its text tower: the
fields come from its `text_config`, the language model's tensors are renamed to the text layout and
the vision tower and projector are left out. Export always writes `gemma3_text`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, ClassVar

from fastlm.config.errors import ConfigIssue
from fastlm.models.gemma3.config import GLOBAL_EVERY, Gemma3Config
from fastlm.models.hf_adapter import (
    FULL,
    SLIDING,
    Reader,
    WeightRule,
    plausible_layers,
    rope_fields,
    rope_parameters,
    rope_to_hf,
)
from fastlm.models.llama.hf import (
    COMMON_DEFAULTS,
    LLAMA_LIKE_FIELDS,
    LlamaAdapter,
    layer_types_to_hf,
    llama_like_to_hf,
    split_rules,
    window_fields,
)

_TEXT_DEFAULTS = {
    **COMMON_DEFAULTS, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "tie_word_embeddings": True, "attention_bias": False,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "layer_types": None, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "use_bidirectional_attention": False, "rope_theta": 1_000_000.0}
# multimodal checkpoint names of the text tower -> the text model's (both transformers layouts)
_TEXT_TOWER = (("language_model.model.", "model."), ("model.language_model.", "model."),
               ("language_model.lm_head.", "lm_head."))
_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class Gemma3Adapter(LlamaAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("gemma3_text", "gemma3")
    defaults: ClassVar[dict[str, dict[str, Any]]] = {"gemma3_text": _TEXT_DEFAULTS, "gemma3": {"tie_word_embeddings": True}}

    def fields(self, reader: Reader, model_type: str) -> dict[str, Any]:
        if model_type == "gemma3":  # the multimodal wrapper: its text tower
            text = reader.hf.get("text_config")
            if not isinstance(text, Mapping):
                reader.fail("text_config", "a multimodal gemma3 config.json needs its text_config", text)
                return {}
            tower = Reader(text, _TEXT_DEFAULTS, reader.source)
            fields = self.fields(tower, "gemma3_text")
            reader.issues += [replace(issue, path=f"text_config.{issue.path}") for issue in tower.issues]
            return {**fields, "tie_embeddings": reader.get("tie_word_embeddings")}  # the wrapper's flag ties
        hf = reader.hf
        fields = reader.fields({**LLAMA_LIKE_FIELDS, "query_pre_attn_scalar": "query_pre_attn_scalar"})
        reader.expect("hidden_activation", ("gelu_pytorch_tanh", "gelu_tanh"), "the MLP is GeGLU with the tanh GELU")
        reader.expect("attention_bias", (False,), "Gemma 3 has no projection biases")
        reader.expect("attention_dropout", (0, 0.0), "model.dropout would also drop residual branches")
        reader.expect("attn_logit_softcapping", (None,), "SDPA / FlexAttention here have no attention softcap")
        reader.expect("final_logit_softcapping", (None,), "export of a softcapped head is not supported")
        reader.expect("use_bidirectional_attention", (False, None), "decoder-only, causal attention")
        nested = isinstance(hf.get("rope_parameters"), Mapping) and any(
            isinstance(hf["rope_parameters"].get(kind), Mapping) for kind in (FULL, SLIDING))
        if nested:
            full, full_key = rope_parameters(reader, FULL)
            local, local_key = rope_parameters(reader, SLIDING)
        else:  # older files: rope_theta (+ rope_scaling) for global layers, rope_local_base_freq for local ones
            full, full_key = rope_parameters(reader)
            local, local_key = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", 10_000.0)}, \
                "rope_local_base_freq"
        fields["rope_theta"], fields["rope_scaling"] = rope_fields(reader, full, full_key, fields["max_seq_len"])
        fields["rope_local_theta"], local_scaling = rope_fields(reader, local, local_key, fields["max_seq_len"])
        if local_scaling is not None:
            reader.fail(f"{local_key}.rope_type", "the sliding layers' RoPE is unscaled here", local.get("rope_type"))
        num_layers = fields["num_layers"]
        if hf.get("layer_types") is None and plausible_layers(reader, num_layers):  # HF derives them from the pattern
            every = hf.get("sliding_window_pattern", GLOBAL_EVERY)
            reader = Reader({**hf, "layer_types": [SLIDING if (i + 1) % every else FULL for i in range(num_layers)]},
                            reader.defaults, reader.source) if isinstance(every, int) and every > 0 else reader
        windows = window_fields(reader, reader.get("sliding_window"), num_layers)
        if windows["layer_types"] is None and windows["sliding_window"] is not None and not reader.issues:  # all local
            windows["layer_types"] = [SLIDING] * num_layers
        return {"type": "gemma3", **fields, **windows, "dropout": 0.0}

    def normalise_keys(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """A multimodal checkpoint's text tower under the text model's names; its vision tensors dropped."""
        renamed = {}
        for key, value in tensors.items():
            if key.startswith(_VISION):
                continue
            for prefix, text in _TEXT_TOWER:
                if key.startswith(prefix):
                    key = text + key.removeprefix(prefix)
                    break
            renamed[key] = value
        return renamed

    def export_issues(self, config: Gemma3Config) -> list[ConfigIssue]:  # type: ignore[override]
        issues = [ConfigIssue("model.dropout", "HF Gemma 3 has attention dropout only", config.dropout,
                              hint="set model.dropout: 0.0")] if config.dropout else []
        if config.qkv_bias:
            issues.append(ConfigIssue("model.qkv_bias", "HF Gemma 3 has q/k/v/o biases together or none", True))
        return issues

    def to_hf(self, config: Gemma3Config) -> dict[str, Any]:  # type: ignore[override]
        hf = llama_like_to_hf(config)
        for key in ("hidden_act", "rope_theta", "rope_scaling"):
            hf.pop(key, None)
        return {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], **hf,
                "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
                "query_pre_attn_scalar": config.query_pre_attn_scalar or config.head_dim,
                "sliding_window": config.sliding_window or 4096, "layer_types": layer_types_to_hf(config),
                "final_logit_softcapping": None, "attn_logit_softcapping": None,
                "rope_parameters": {FULL: rope_to_hf(config.rope_theta, config.rope_scaling),
                                    SLIDING: rope_to_hf(config.rope_local_theta, None)}}

    def layer_rules(self, config: Gemma3Config, layer: int, base: str, hf: str) -> list[WeightRule]:  # type: ignore[override]
        norms = (("attn_norm", "input_layernorm"), ("post_attn_norm", "post_attention_layernorm"),
                 ("mlp_norm", "pre_feedforward_layernorm"), ("post_mlp_norm", "post_feedforward_layernorm"),
                 ("attn.q_norm", "self_attn.q_norm"), ("attn.k_norm", "self_attn.k_norm"))
        return [*(WeightRule(f"{base}.{ours}.weight", (f"{hf}.{theirs}.weight",)) for ours, theirs in norms),
                *split_rules(config, layer, base, hf)]
