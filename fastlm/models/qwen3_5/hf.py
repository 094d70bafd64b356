"""Qwen3.5 / Qwen3-Next <-> Hugging Face: `qwen3_5_text` (dense), `qwen3_5_moe_text` (experts + gated shared
expert in every layer), their multimodal wrappers `qwen3_5` / `qwen3_5_moe` (the text tower: fields from
`text_config`, `model.language_model.*` tensors; the vision tower is left out) and `qwen3_next` (the fused,
per-group interleaved `in_proj_qkvz` / `in_proj_ba`; experts from `decoder_sparse_step` / `mlp_only_layers`).

RoPE: `partial_rotary_factor` becomes `partial_rotary_factor`; the multimodal checkpoints' mrope
(`mrope_section`, `mrope_interleaved`) is plain RoPE on text, where all three position sections are equal,
so it is read as such (image and video positions are out of scope). Multi-token-prediction tensors
(`mtp.*`) are dropped on import (the config says so) and not written on export."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, ClassVar

from fastlm.config.errors import ConfigIssue
from fastlm.models.hf_adapter import FULL, Reader, WeightRule, rope_fields, rope_parameters, rope_to_hf
from fastlm.models.llama.hf import COMMON_DEFAULTS, LLAMA_LIKE_FIELDS, SILU_ACTIVATIONS, LlamaAdapter
from fastlm.models.moe_family import gated_shared_expert_rules, hf_dense_layers, moe_settings
from fastlm.models.qwen3_5.config import Qwen35Config

LINEAR = "linear_attention"
_TEXT_DEFAULTS = {
    **COMMON_DEFAULTS, "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 32768,
    "attention_bias": False, "attn_output_gate": True, "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
    "layer_types": None,
    "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32}
_MOE_DEFAULTS = {**_TEXT_DEFAULTS, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
                 "num_key_value_heads": 2, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                 "num_experts_per_tok": 8, "num_experts": 256, "router_aux_loss_coef": 0.001}
_NEXT_DEFAULTS = {**_MOE_DEFAULTS, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
                  "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
                  "max_position_embeddings": 32768, "linear_num_value_heads": 32, "linear_num_key_heads": 16,
                  "decoder_sparse_step": 1, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                  "num_experts_per_tok": 10, "num_experts": 512, "norm_topk_prob": True, "mlp_only_layers": []}
_WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
_TEXT_TOWER = (("model.language_model.", "model."),)
_DROPPED = ("mtp.", "model.visual.", "visual.")


class Qwen35Adapter(LlamaAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe",
                                              "qwen3_next")
    defaults: ClassVar[dict[str, dict[str, Any]]] = {
        "qwen3_5_text": _TEXT_DEFAULTS, "qwen3_5_moe_text": _MOE_DEFAULTS, "qwen3_next": _NEXT_DEFAULTS,
        "qwen3_5": {}, "qwen3_5_moe": {}}

    def fields(self, reader: Reader, model_type: str) -> dict[str, Any]:
        if model_type in _WRAPPERS:  # the multimodal checkpoint: its text tower
            text = reader.hf.get("text_config")
            if not isinstance(text, Mapping):
                reader.fail("text_config", f"a multimodal {model_type} config.json needs its text_config", text)
                return {}
            tied = reader.hf.get("tie_word_embeddings", text.get("tie_word_embeddings"))
            tower = Reader({**text, "tie_word_embeddings": bool(tied)}, self.defaults[_WRAPPERS[model_type]],
                           reader.source)
            fields = self.fields(tower, _WRAPPERS[model_type])
            reader.issues += [replace(issue, path=f"text_config.{issue.path}") for issue in tower.issues]
            return fields
        fields = reader.fields(LLAMA_LIKE_FIELDS)
        reader.expect("hidden_act", SILU_ACTIVATIONS, "the MLPs are SwiGLU")
        reader.expect("attention_bias", (False,), "the attention has no biases")
        reader.expect("attention_dropout", (0, 0.0), "model.dropout would also drop residual branches")
        reader.expect("attn_output_gate", (True,), "the full-attention layers here have the output gate")
        parameters, key = rope_parameters(reader)
        partial = parameters.pop("partial_rotary_factor", reader.get("partial_rotary_factor"))
        for text_positions_only in ("mrope_section", "mrope_interleaved"):  # equal sections on text: plain RoPE
            parameters.pop(text_positions_only, None)
        plain = Reader({k: v for k, v in reader.hf.items() if k != "partial_rotary_factor"}, reader.defaults,
                       reader.source)
        plain.issues = reader.issues  # one list of problems
        fields["rope_theta"], fields["rope_scaling"] = rope_fields(plain, parameters, key, fields["max_seq_len"])
        linear = {"key_heads": reader.get("linear_num_key_heads"), "value_heads": reader.get("linear_num_value_heads"),
                  "key_head_dim": reader.get("linear_key_head_dim"),
                  "value_head_dim": reader.get("linear_value_head_dim"),
                  "conv_kernel": reader.get("linear_conv_kernel_dim")}
        result = {"type": "qwen3_5", **fields, "dropout": 0.0, "partial_rotary_factor": partial,
                  "full_attention_interval": reader.get("full_attention_interval"),
                  "layer_types": self._layer_types(reader, fields["num_layers"]), "linear_attention": linear,
                  "fused_linear_projections": model_type == "qwen3_next"}
        if model_type == "qwen3_5_text":
            return result
        num_experts = reader.get("num_experts")
        if model_type == "qwen3_next" and num_experts == 0:  # Qwen3-Next without experts: dense MLPs
            return result
        normalize = reader.get("norm_topk_prob") if model_type == "qwen3_next" else True
        moe = moe_settings(reader, ("num_experts",), "moe_intermediate_size", normalize)
        dense = hf_dense_layers(reader, fields["num_layers"]) if model_type == "qwen3_next" else []
        return {**result, "moe": moe, "shared_expert_size": reader.get("shared_expert_intermediate_size"),
                "dense_layers": dense}

    @staticmethod
    def _layer_types(reader: Reader, num_layers: Any) -> list[str] | None:
        given = reader.hf.get("layer_types")
        if given is None:
            return None
        if not isinstance(given, list) or not set(given) <= {LINEAR, FULL}:
            reader.fail("layer_types", f"must be a list of {LINEAR!r} / {FULL!r}", given)
            return None
        return given

    def normalise_keys(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """The multimodal text tower under the text model's names; vision and multi-token-prediction dropped."""
        renamed = {}
        for key, value in tensors.items():
            if key.startswith(_DROPPED):
                continue
            for prefix, text in _TEXT_TOWER:
                if key.startswith(prefix):
                    key = text + key.removeprefix(prefix)
            renamed[key] = value
        return renamed

    @staticmethod
    def model_type(config: Qwen35Config) -> str:  # type: ignore[override]
        if config.fused_linear_projections:
            return "qwen3_next"
        return "qwen3_5_text" if config.moe is None else "qwen3_5_moe_text"

    def export_issues(self, config: Qwen35Config) -> list[ConfigIssue]:  # type: ignore[override]
        issues = []
        if config.dropout:
            issues.append(ConfigIssue("model.dropout", "HF Qwen3.5 has attention dropout only", config.dropout,
                                      hint="set model.dropout: 0.0"))
        if config.moe is not None and config.shared_expert_size is None:
            issues.append(ConfigIssue("model.shared_expert_size", "HF Qwen3.5-MoE / Qwen3-Next layers always have "
                                      "a shared expert", None, hint="set shared_expert_size"))
        if self.model_type(config) == "qwen3_5_moe_text" and config.moe is not None:
            if config.dense_layers:
                issues.append(ConfigIssue("model.dense_layers", "HF Qwen3.5-MoE has experts in every layer",
                                          config.dense_layers, hint="export as fused_linear_projections (qwen3_next)"))
            if not config.moe.normalize_top_k:
                issues.append(ConfigIssue("model.moe.normalize_top_k", "HF Qwen3.5-MoE always renormalises the "
                                          "top-k weights", False))
        return issues

    def to_hf(self, config: Qwen35Config) -> dict[str, Any]:  # type: ignore[override]
        model_type = self.model_type(config)
        architectures = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                         "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}
        linear = config.linear_attention
        rope = {**rope_to_hf(config.rope_theta, config.rope_scaling),
                "partial_rotary_factor": config.partial_rotary_factor}
        hf = {"model_type": model_type, "architectures": [architectures[model_type]],
              "hidden_size": config.hidden_size, "intermediate_size": config.ffn_size,
              "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
              "num_key_value_heads": config.kv_heads, "head_dim": config.head_dim, "hidden_act": "silu",
              "max_position_embeddings": config.max_seq_len, "rms_norm_eps": config.norm_eps,
              "attention_bias": False, "attention_dropout": 0.0, "rope_parameters": rope,
              "full_attention_interval": config.full_attention_interval,
              "layer_types": [FULL if not config.is_linear(i) else LINEAR for i in range(config.num_layers)],
              "linear_conv_kernel_dim": linear.conv_kernel, "linear_key_head_dim": linear.key_head_dim,
              "linear_value_head_dim": linear.value_head_dim, "linear_num_key_heads": linear.key_heads,
              "linear_num_value_heads": linear.value_heads}
        if config.moe is None:
            return {**hf, "num_experts": 0} if model_type == "qwen3_next" else hf
        moe = {"num_experts": config.moe.num_experts, "moe_intermediate_size": config.moe.ffn_size,
               "shared_expert_intermediate_size": config.shared_expert_size, **config.moe.hf_fields()}
        if model_type == "qwen3_next":
            return {**hf, **moe, "decoder_sparse_step": 1, "mlp_only_layers": list(config.dense_layers)}
        moe.pop("norm_topk_prob")
        return {**hf, **moe}

    def layer_rules(self, config: Qwen35Config, layer: int, base: str, hf: str) -> list[WeightRule]:  # type: ignore[override]
        rules = [WeightRule(f"{base}.attn_norm.weight", (f"{hf}.input_layernorm.weight",)),
                 WeightRule(f"{base}.mlp_norm.weight", (f"{hf}.post_attention_layernorm.weight",))]
        if config.is_linear(layer):
            names = (("in_proj_qkvz", "in_proj_ba") if config.fused_linear_projections
                     else ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
            rules += [WeightRule(f"{base}.attn.{name}.weight", (f"{hf}.linear_attn.{name}.weight",))
                      for name in (*names, "conv1d", "norm", "out_proj")]
            rules += [WeightRule(f"{base}.attn.{name}", (f"{hf}.linear_attn.{name}",)) for name in ("A_log", "dt_bias")]
        else:
            head_dim = config.head_dim or 0
            q_size, kv_size = config.num_heads * head_dim, config.kv_heads * head_dim
            attn = f"{hf}.self_attn"
            rules += [WeightRule(f"{base}.attn.qkv_proj.weight", tuple(f"{attn}.{p}_proj.weight" for p in "qkv"),
                                 (2 * q_size, kv_size, kv_size)),
                      WeightRule(f"{base}.attn.out_proj.weight", (f"{attn}.o_proj.weight",)),
                      WeightRule(f"{base}.attn.q_norm.weight", (f"{attn}.q_norm.weight",)),
                      WeightRule(f"{base}.attn.k_norm.weight", (f"{attn}.k_norm.weight",))]
        ffn, mlp = config.ffn_size, f"{hf}.mlp"
        dense = [WeightRule(f"{base}.mlp.gate_up_proj.weight", (f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"),
                            (ffn, ffn)),
                 WeightRule(f"{base}.mlp.down_proj.weight", (f"{mlp}.down_proj.weight",))]
        if not config.is_sparse(layer):
            return rules + dense
        assert config.moe is not None
        return rules + gated_shared_expert_rules(config.moe, base, mlp, config.hidden_size, config.shared_expert_size)
