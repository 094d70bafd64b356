"""Gemma 4 (text) <-> Hugging Face `gemma4_text`: Gemma 3's tensor layout (q/k/v/o, q_norm / k_norm, four
norms per layer, gate/up/down) plus each layer's `layer_scalar`; global layers with their own head width and
kv heads (transformers 5.25 saves them as `per_layer_config`, the published files as `global_head_dim` /
`num_global_key_value_heads`) and without `v_proj` under `attention_k_eq_v`; RoPE per layer type
(`proportional` on the global layers: partial_rotary_factor of the frequencies turn).

E2B / E4B's per-layer input embeddings (`hidden_size_per_layer_input`: `embed_tokens_per_layer`,
`per_layer_model_projection`, `per_layer_projection_norm`, and per layer `per_layer_input_gate`,
`per_layer_projection`, `post_per_layer_input_norm`), KV shared across the last `num_kv_shared_layers` (their
k/v projections and norms, which checkpoints may still hold and transformers ignores, are left out too) and their
double-wide MLPs (`use_double_wide_mlp`) convert, and so does 26B-A4B's MoE block (`enable_moe_block`: `router`
proj / scale / per_expert_scale, `experts` gate_up_proj (E, 2F, H) and down_proj (E, H, F), stored here as row
stacks, and the norms `pre_feedforward_layernorm_2`, `post_feedforward_layernorm_1` / `_2`). Refused, naming
the key: bidirectional attention (`use_bidirectional_attention: all`), RoPE scaling. A multimodal `gemma4`
checkpoint imports as its text tower (`text_config`; the vision and audio towers and their embedders are
left out). Export always writes `gemma4_text`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, ClassVar

from fastlm.config.errors import ConfigIssue
from fastlm.models.gemma4.config import GLOBAL_EVERY, Gemma4Config
from fastlm.models.hf_adapter import FULL, SLIDING, Reader, WeightRule, plausible_layers, rope_parameters
from fastlm.models.llama.hf import COMMON_DEFAULTS, LLAMA_LIKE_FIELDS, LlamaAdapter, layer_types_to_hf, window_fields

_TEXT_DEFAULTS = {
    **COMMON_DEFAULTS, "vocab_size": 262_144, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 30, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "tie_word_embeddings": True,
    "attention_bias": False, "sliding_window": 512, "layer_types": None, "final_logit_softcapping": None,
    "use_bidirectional_attention": None, "hidden_size_per_layer_input": 256, "attention_k_eq_v": False,
    "num_kv_shared_layers": 0, "enable_moe_block": False, "global_head_dim": 512, "use_double_wide_mlp": False,
    "vocab_size_per_layer_input": 262_144, "num_experts": None, "top_k_experts": None, "moe_intermediate_size": None,
    "num_global_key_value_heads": None, "per_layer_config": None, "rope_parameters": None}
_DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                 FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
# multimodal checkpoint names of the text tower -> the text model's; the other towers are left out
_TEXT_TOWER = (("model.language_model.", "model."),)
_OTHER_TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
_EXPERT_STACKS = (".experts.gate_up_proj", ".experts.down_proj")
_NORMS = (("attn_norm", "input_layernorm"), ("post_attn_norm", "post_attention_layernorm"),
          ("mlp_norm", "pre_feedforward_layernorm"), ("post_mlp_norm", "post_feedforward_layernorm"),
          ("attn.q_norm", "self_attn.q_norm"), ("attn.k_norm", "self_attn.k_norm"))


class Gemma4Adapter(LlamaAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("gemma4_text", "gemma4")
    # KV-sharing layers' k/v projections and k_norm, which published checkpoints hold and transformers ignores (a
    # layer that computes keys and values names them among its rules, so a missing one is still an error)
    ignored_suffixes: ClassVar[tuple[str, ...]] = (*LlamaAdapter.ignored_suffixes, ".self_attn.k_proj.weight",
                                                   ".self_attn.v_proj.weight", ".self_attn.k_norm.weight")
    defaults: ClassVar[dict[str, dict[str, Any]]] = {"gemma4_text": _TEXT_DEFAULTS, "gemma4": {"tie_word_embeddings": True}}

    def fields(self, reader: Reader, model_type: str) -> dict[str, Any]:
        if model_type == "gemma4":  # the multimodal wrapper: its text tower
            text = reader.hf.get("text_config")
            if not isinstance(text, Mapping):
                reader.fail("text_config", "a multimodal gemma4 config.json needs its text_config", text)
                return {}
            tower = Reader(text, _TEXT_DEFAULTS, reader.source)
            fields = self.fields(tower, "gemma4_text")
            reader.issues += [replace(issue, path=f"text_config.{issue.path}") for issue in tower.issues]
            return {**fields, "tie_embeddings": reader.get("tie_word_embeddings")}  # the wrapper's flag ties
        fields = reader.fields(LLAMA_LIKE_FIELDS)
        reader.expect("hidden_activation", ("gelu_pytorch_tanh", "gelu_tanh"), "the MLP is GeGLU with the tanh GELU")
        reader.expect("attention_bias", (False,), "Gemma 4 has no projection biases")
        reader.expect("attention_dropout", (0, 0.0), "model.dropout would also drop residual branches")
        reader.expect("use_bidirectional_attention", (None, "vision"), "decoder-only, causal attention over text")
        fields.update(self._rope(reader))
        num_layers = fields["num_layers"]
        kinds = reader.hf.get("layer_types")
        if kinds is None and plausible_layers(reader, num_layers):  # transformers' default pattern
            kinds = [SLIDING if (i + 1) % GLOBAL_EVERY else FULL for i in range(num_layers)]
        if isinstance(kinds, list) and kinds and kinds[-1] == SLIDING:
            kinds = [*kinds[:-1], FULL]  # transformers forces the last layer global
        derived = Reader({**reader.hf, "layer_types": kinds}, reader.defaults, reader.source)
        windows = window_fields(derived, reader.get("sliding_window"), num_layers)
        reader.issues += derived.issues
        if windows["layer_types"] is None and windows["sliding_window"] is not None:  # every layer slides
            windows["layer_types"] = [SLIDING] * num_layers
        values_from_keys = reader.get("attention_k_eq_v")
        global_shape = self._global_shape(reader, kinds, values_from_keys, fields)
        return {"type": "gemma4", **fields, **windows, **global_shape, "values_from_keys": values_from_keys,
                "final_logit_softcap": reader.get("final_logit_softcapping"), "dropout": 0.0,
                "per_layer_input_width": reader.get("hidden_size_per_layer_input") or 0,
                "per_layer_vocab_size": reader.get("vocab_size_per_layer_input")
                if reader.get("hidden_size_per_layer_input") else None,
                "kv_shared_layers": reader.get("num_kv_shared_layers"),
                "double_wide_mlp": reader.get("use_double_wide_mlp"), "moe": self._moe(reader)}

    @staticmethod
    def _moe(reader: Reader) -> dict[str, Any] | None:
        if not reader.get("enable_moe_block"):
            return None
        return {"num_experts": reader.get("num_experts"), "top_k": reader.get("top_k_experts"),
                "ffn_size": reader.get("moe_intermediate_size"), "normalize_top_k": True}

    @staticmethod
    def _rope(reader: Reader) -> dict[str, Any]:
        """The sliding layers' plain RoPE base, the global layers' base and proportional factor."""
        if not reader.hf.get("rope_parameters"):  # transformers' defaults (no problems to report in them)
            reader = Reader({**reader.hf, "rope_parameters": _DEFAULT_ROPE}, reader.defaults, reader.source)
        local, local_key = rope_parameters(reader, SLIDING)
        full, full_key = rope_parameters(reader, FULL)
        if local.get("rope_type") != "default":
            reader.fail(f"{local_key}.rope_type", "the sliding layers' RoPE is plain here", local.get("rope_type"))
        if local.get("partial_rotary_factor", 1.0) != 1.0:
            reader.fail(f"{local_key}.partial_rotary_factor", "the sliding layers rotate the whole head here",
                        local.get("partial_rotary_factor"))
        if full.get("rope_type") not in ("default", "proportional"):
            reader.fail(f"{full_key}.rope_type", "the global layers' RoPE is default or proportional here",
                        full.get("rope_type"), "scaled RoPE is not supported for Gemma 4")
        if full.get("factor", 1.0) != 1.0:
            reader.fail(f"{full_key}.factor", "scaled proportional RoPE is not supported", full.get("factor"))
        if full.get("rope_type") == "default" and full.get("partial_rotary_factor", 1.0) != 1.0:
            reader.fail(f"{full_key}.partial_rotary_factor", "partial rotary is read with rope_type proportional only",
                        full.get("partial_rotary_factor"))
        return {"rope_local_theta": local.get("rope_theta"), "rope_theta": full.get("rope_theta"),
                "partial_rotary_factor": full.get("partial_rotary_factor", 1.0)}

    @staticmethod
    def _global_shape(reader: Reader, kinds: Any, values_from_keys: Any, fields: dict[str, Any]) -> dict[str, Any]:
        """global_head_dim and num_global_kv_heads: from `per_layer_config` (transformers 5.25's files: the same
        override on every global layer, none on sliding ones), else `global_head_dim` / `num_global_key_value_heads`
        (the latter only with attention_k_eq_v, as transformers reads it)."""
        overrides = reader.hf.get("per_layer_config")
        if overrides is None:
            heads = reader.get("num_global_key_value_heads") if values_from_keys else None
            return {"global_head_dim": reader.get("global_head_dim"), "num_global_kv_heads": heads}
        if not isinstance(overrides, Mapping) or not isinstance(kinds, list):
            reader.fail("per_layer_config", "must map layer indices to head_dim / num_key_value_heads", overrides)
            return {}
        by_layer = {str(layer): overrides.get(str(layer), overrides.get(layer)) or {} for layer in range(len(kinds))}
        globals_ = {str(layer) for layer, kind in enumerate(kinds) if kind == FULL}
        distinct = {tuple(sorted(by_layer[layer].items())) for layer in globals_}
        sliding = [layer for layer in by_layer if layer not in globals_ and by_layer[layer]]
        unknown = {key for value in by_layer.values() for key in value} - {"head_dim", "num_key_value_heads"}
        if len(distinct) > 1 or sliding or unknown or len(overrides) > len(globals_):
            reader.fail("per_layer_config", "only one head_dim / num_key_value_heads override shared by every "
                        "full_attention layer is supported", overrides)
            return {}
        override = dict(next(iter(distinct), ()))
        return {"global_head_dim": override.get("head_dim", fields["head_dim"]),
                "num_global_kv_heads": override.get("num_key_value_heads")}

    def normalise_keys(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """A multimodal checkpoint's text tower under the text model's names; its other towers dropped; the
        experts' (E, 2F, H) / (E, H, F) stacks as fastlm's (E * 2F, H) / (E * H, F) row stacks."""
        renamed = {}
        for key, value in tensors.items():
            if key.startswith(_OTHER_TOWERS):
                continue
            for prefix, text in _TEXT_TOWER:
                if key.startswith(prefix):
                    key = text + key.removeprefix(prefix)
                    break
            stacked = key.endswith(_EXPERT_STACKS) and getattr(value, "dim", lambda: 0)() == 3
            renamed[key] = value.reshape(-1, value.shape[-1]) if stacked else value
        return renamed

    def checkpoint_layout(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Inverse of `normalise_keys`' reshape: the experts as transformers stacks them, (E, rows, columns)."""
        out = dict(tensors)
        for key, value in tensors.items():
            if key.endswith(_EXPERT_STACKS):
                experts = tensors[key.rsplit(".", 2)[0] + ".router.per_expert_scale"].shape[0]
                out[key] = value.reshape(experts, -1, value.shape[-1]).contiguous()
        return out

    def export_issues(self, config: Gemma4Config) -> list[ConfigIssue]:  # type: ignore[override]
        issues = [ConfigIssue("model.dropout", "HF Gemma 4 has attention dropout only", config.dropout,
                              hint="set model.dropout: 0.0")] if config.dropout else []
        if config.qkv_bias:
            issues.append(ConfigIssue("model.qkv_bias", "HF Gemma 4 has q/k/v/o biases together or none", True))
        if config.num_layers and config.is_sliding(config.num_layers - 1):
            issues.append(ConfigIssue("model.layer_types", "HF Gemma 4 makes the last layer full_attention",
                                      config.layer_types))
        return issues

    def to_hf(self, config: Gemma4Config) -> dict[str, Any]:  # type: ignore[override]
        kinds = layer_types_to_hf(config)
        override = {"head_dim": config.global_width, "num_key_value_heads": config.global_kv_heads}
        full = ({"rope_type": "proportional", "partial_rotary_factor": config.partial_rotary_factor}
                if config.partial_rotary_factor != 1.0 else {"rope_type": "default"})
        return {"model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"],
                "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
                "intermediate_size": config.ffn_size, "num_hidden_layers": config.num_layers,
                "num_attention_heads": config.num_heads, "num_key_value_heads": config.kv_heads,
                "head_dim": config.head_dim, "hidden_activation": "gelu_pytorch_tanh",
                "max_position_embeddings": config.max_seq_len, "rms_norm_eps": config.norm_eps,
                "attention_bias": False, "attention_dropout": 0.0, "sliding_window": config.sliding_window or 512,
                "layer_types": kinds, "final_logit_softcapping": config.final_logit_softcap,
                "hidden_size_per_layer_input": config.per_layer_input_width,
                "vocab_size_per_layer_input": config.per_layer_vocab_size or config.vocab_size,
                "num_kv_shared_layers": config.kv_shared_layers, "use_double_wide_mlp": config.double_wide_mlp,
                "enable_moe_block": config.moe is not None,
                **({} if config.moe is None else {"num_experts": config.moe.num_experts, "top_k_experts": config.moe.top_k,
                                                  "moe_intermediate_size": config.moe.ffn_size}),
                "attention_k_eq_v": config.values_from_keys,
                "per_layer_config": {str(layer): override for layer, kind in enumerate(kinds) if kind == FULL},
                "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": config.rope_local_theta},
                                    FULL: {**full, "rope_theta": config.rope_theta}}}

    def weight_rules(self, config: Gemma4Config) -> list[WeightRule]:  # type: ignore[override]
        rules = super().weight_rules(config)
        if not config.per_layer_input_width:
            return rules
        return rules + [WeightRule("layer_inputs.tokens.weight", ("model.embed_tokens_per_layer.weight",)),
                        WeightRule("layer_inputs.projection.weight", ("model.per_layer_model_projection.weight",)),
                        WeightRule("layer_inputs.norm.weight", ("model.per_layer_projection_norm.weight",))]

    def layer_rules(self, config: Gemma4Config, layer: int, base: str, hf: str) -> list[WeightRule]:  # type: ignore[override]
        kv_heads, width = config.layer_kv_shape(layer)
        q_size, kv_size, ffn = config.num_heads * width, kv_heads * width, config.layer_ffn_size(layer)
        projections = ("q", "k") if config.values_from_keys and not config.is_sliding(layer) else ("q", "k", "v")
        own_kv = config.kv_source(layer) == layer
        projections = projections if own_kv else ("q",)
        norms = _NORMS if own_kv else _NORMS[:-1]
        mixer = ((("layer_input_mixer.gate", "per_layer_input_gate"),
                  ("layer_input_mixer.projection", "per_layer_projection"),
                  ("layer_input_mixer.norm", "post_per_layer_input_norm")) if config.per_layer_input_width else ())
        if config.moe is not None:  # the dense MLP's pre-norm is inside the MLP slot, beside the experts' norms
            mlp = f"{base}.mlp"
            norms = tuple(pair for pair in norms if pair[0] != "mlp_norm") + (
                ("mlp.dense_norm", "pre_feedforward_layernorm"), ("mlp.post_dense_norm", "post_feedforward_layernorm_1"),
                ("mlp.post_experts_norm", "post_feedforward_layernorm_2"),
                ("mlp.experts.expert_norm", "pre_feedforward_layernorm_2"), ("mlp.experts.router", "router.proj"))
            experts = [WeightRule(f"{mlp}.experts.router_scale", (f"{hf}.router.scale",)),
                       WeightRule(f"{mlp}.experts.per_expert_scale", (f"{hf}.router.per_expert_scale",)),
                       WeightRule(f"{mlp}.experts.gate_up_proj", (f"{hf}.experts.gate_up_proj",)),
                       WeightRule(f"{mlp}.experts.down_proj", (f"{hf}.experts.down_proj",))]
            base_mlp = f"{base}.mlp.dense"
        else:
            experts, base_mlp = [], f"{base}.mlp"
        return [*experts, *(WeightRule(f"{base}.{ours}.weight", (f"{hf}.{theirs}.weight",)) for ours, theirs in norms + mixer),
                WeightRule(f"{base}.layer_scalar", (f"{hf}.layer_scalar",)),
                WeightRule(f"{base}.attn.qkv_proj.weight", tuple(f"{hf}.self_attn.{p}_proj.weight" for p in projections),
                           (q_size, kv_size, kv_size)[:len(projections)]),
                WeightRule(f"{base}.attn.out_proj.weight", (f"{hf}.self_attn.o_proj.weight",)),
                WeightRule(f"{base_mlp}.gate_up_proj.weight", (f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight"),
                           (ffn, ffn)),
                WeightRule(f"{base_mlp}.down_proj.weight", (f"{hf}.mlp.down_proj.weight",))]
