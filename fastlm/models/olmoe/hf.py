"""OLMoE <-> Hugging Face `olmoe`: Llama names plus `self_attn.q_norm` / `k_norm` (full width), the
sparse MLP under `mlp` (router `gate`, experts gate_proj / up_proj / down_proj)."""

from __future__ import annotations

from typing import Any, ClassVar

from fastlm.config.errors import ConfigIssue
from fastlm.models.hf_adapter import Reader, WeightRule
from fastlm.models.llama.hf import SILU_ACTIVATIONS, LlamaAdapter, llama_like_fields, llama_like_to_hf
from fastlm.models.moe_family import moe_settings, sparse_layer_rules
from fastlm.models.olmoe.config import OlmoeConfig


class OlmoeAdapter(LlamaAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("olmoe",)
    defaults: ClassVar[dict[str, dict[str, Any]]] = {
        "olmoe": {"hidden_act": "silu", "initializer_range": 0.02, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                  "attention_dropout": 0.0, "attention_bias": False, "clip_qkv": None, "head_dim": None,
                  "num_key_value_heads": None, "max_position_embeddings": 4096, "rope_theta": 10000.0,
                  "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False, "router_aux_loss_coef": 0.01},
    }

    def fields(self, reader: Reader, model_type: str) -> dict[str, Any]:
        fields = llama_like_fields(reader)
        reader.expect("hidden_act", SILU_ACTIVATIONS, "the experts are SwiGLU")
        reader.expect("attention_bias", (False,), "OLMoE's projections have no biases")
        reader.expect("clip_qkv", (None,), "fastlm does not clamp q/k/v")
        moe = moe_settings(reader, ("num_experts",), "intermediate_size", reader.get("norm_topk_prob"))
        return {"type": "olmoe", **fields, "intermediate_size": None, "head_dim": None, "moe": moe}

    def export_issues(self, config: OlmoeConfig) -> list[ConfigIssue]:  # type: ignore[override]
        if config.qkv_bias or config.dropout or config.sliding_window is not None:
            return [ConfigIssue("model", "HF OLMoE has no q/k/v biases, dropout or sliding window", None,
                                hint="set qkv_bias: false, dropout: 0.0, sliding_window: null")]
        if config.head_dim != config.hidden_size // config.num_heads:
            return [ConfigIssue("model.head_dim", "HF OLMoE's head_dim is hidden_size / num_heads", config.head_dim)]
        return []

    def to_hf(self, config: OlmoeConfig) -> dict[str, Any]:  # type: ignore[override]
        hf = llama_like_to_hf(config)
        hf.pop("head_dim")
        return {"model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], **hf, "attention_bias": False,
                "clip_qkv": None, "num_experts": config.moe.num_experts, **config.moe.hf_fields()}

    def layer_rules(self, config: OlmoeConfig, layer: int, base: str, hf: str) -> list[WeightRule]:  # type: ignore[override]
        rules = sparse_layer_rules(super().layer_rules(config, layer, base, hf), config.moe, base, f"{hf}.mlp",
                                   ("gate_proj", "up_proj", "down_proj"), config.hidden_size)
        return rules + [WeightRule(f"{base}.attn.{name}.weight", (f"{hf}.self_attn.{name}.weight",))
                        for name in ("q_norm", "k_norm")]
