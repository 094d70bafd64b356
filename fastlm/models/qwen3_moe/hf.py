"""Qwen3-MoE <-> Hugging Face `qwen3_moe`: Qwen3's names, the sparse MLP under `mlp` (router `gate`, experts
gate_proj / up_proj / down_proj), dense layers from `mlp_only_layers` and `decoder_sparse_step`."""

from __future__ import annotations

from typing import Any, ClassVar

from fastlm.models.hf_adapter import Reader, WeightRule
from fastlm.models.moe_family import hf_dense_layers, moe_settings, sparse_layer_rules
from fastlm.models.qwen3.hf import Qwen3Adapter
from fastlm.models.qwen3_moe.config import Qwen3MoeConfig


class Qwen3MoeAdapter(Qwen3Adapter):
    model_types: ClassVar[tuple[str, ...]] = ("qwen3_moe",)
    defaults: ClassVar[dict[str, dict[str, Any]]] = {"qwen3_moe": {
        **Qwen3Adapter.defaults["qwen3"], "num_key_value_heads": 4, "head_dim": None, "intermediate_size": 6144,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 768, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": False, "router_aux_loss_coef": 0.001}}

    def fields(self, reader: Reader, model_type: str) -> dict[str, Any]:
        fields = super().fields(reader, "qwen3")
        moe = moe_settings(reader, ("num_experts", "num_local_experts"), "moe_intermediate_size",
                           reader.get("norm_topk_prob"))
        return {**fields, "type": "qwen3_moe", "moe": moe,
                "dense_layers": hf_dense_layers(reader, fields["num_layers"])}

    def to_hf(self, config: Qwen3MoeConfig) -> dict[str, Any]:  # type: ignore[override]
        return {**super().to_hf(config), "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                "num_experts": config.moe.num_experts, "moe_intermediate_size": config.moe.ffn_size,
                "decoder_sparse_step": 1, "mlp_only_layers": list(config.dense_layers), **config.moe.hf_fields()}

    def layer_rules(self, config: Qwen3MoeConfig, layer: int, base: str, hf: str) -> list[WeightRule]:  # type: ignore[override]
        rules = super().layer_rules(config, layer, base, hf)
        if not config.is_sparse(layer):
            return rules
        return sparse_layer_rules(rules, config.moe, base, f"{hf}.mlp", ("gate_proj", "up_proj", "down_proj"),
                                  config.hidden_size)
