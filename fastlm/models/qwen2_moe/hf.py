"""Qwen2-MoE <-> Hugging Face `qwen2_moe`: Qwen2's names (q/k/v biases, windows from `use_sliding_window`,
`max_window_layers`, `layer_types`), the sparse MLP under `mlp` (router `gate`, `experts.e.*`, `shared_expert`,
`shared_expert_gate`), dense layers from `mlp_only_layers` and `decoder_sparse_step`."""

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
from fastlm.models.moe_family import gated_shared_expert_rules, hf_dense_layers, moe_settings
from fastlm.models.qwen2_moe.config import Qwen2MoeConfig


class Qwen2MoeAdapter(LlamaAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("qwen2_moe",)
    defaults: ClassVar[dict[str, dict[str, Any]]] = {"qwen2_moe": {
        **COMMON_DEFAULTS, "num_key_value_heads": 16, "max_position_embeddings": 32768, "use_sliding_window": False,
        "sliding_window": 4096, "max_window_layers": 28, "layer_types": None, "decoder_sparse_step": 1,
        "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4,
        "num_experts": 60, "norm_topk_prob": False, "router_aux_loss_coef": 0.001, "mlp_only_layers": [],
        "qkv_bias": True, "intermediate_size": 5632}}

    def fields(self, reader: Reader, model_type: str) -> dict[str, Any]:
        fields = llama_like_fields(reader)
        reader.expect("hidden_act", SILU_ACTIVATIONS, "the MLPs are SwiGLU")
        window = reader.get("sliding_window") if reader.get("use_sliding_window") else None
        windows = window_fields(reader, window, fields["num_layers"], reader.get("max_window_layers"))
        moe = moe_settings(reader, ("num_experts",), "moe_intermediate_size", reader.get("norm_topk_prob"))
        shared = reader.get("shared_expert_intermediate_size")
        return {**fields, **windows, "type": "qwen2_moe", "qkv_bias": bool(reader.get("qkv_bias")), "moe": moe,
                "shared_expert_size": shared or None,
                "dense_layers": hf_dense_layers(reader, fields["num_layers"])}

    def export_issues(self, config: Qwen2MoeConfig) -> list[ConfigIssue]:  # type: ignore[override]
        issues = []
        if config.dropout:
            issues.append(ConfigIssue("model.dropout", "HF Qwen2-MoE has attention dropout only", config.dropout,
                                      hint="set model.dropout: 0.0"))
        if config.shared_expert_size is None:
            issues.append(ConfigIssue("model.shared_expert_size", "HF Qwen2-MoE layers always have a shared expert",
                                      None, hint="set shared_expert_size"))
        return issues

    def to_hf(self, config: Qwen2MoeConfig) -> dict[str, Any]:  # type: ignore[override]
        window = config.sliding_window
        return {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], **llama_like_to_hf(config),
                "qkv_bias": config.qkv_bias, "use_sliding_window": window is not None, "sliding_window": window,
                "max_window_layers": config.num_layers if window is None else 0,
                "layer_types": layer_types_to_hf(config), "num_experts": config.moe.num_experts,
                "moe_intermediate_size": config.moe.ffn_size,
                "shared_expert_intermediate_size": config.shared_expert_size, "decoder_sparse_step": 1,
                "mlp_only_layers": list(config.dense_layers), **config.moe.hf_fields()}

    def layer_rules(self, config: Qwen2MoeConfig, layer: int, base: str, hf: str) -> list[WeightRule]:  # type: ignore[override]
        rules = super().layer_rules(config, layer, base, hf)
        if not config.is_sparse(layer):
            return rules
        return [rule for rule in rules if not rule.ours.startswith(f"{base}.mlp.")] + gated_shared_expert_rules(
            config.moe, base, f"{hf}.mlp", config.hidden_size, config.shared_expert_size)
