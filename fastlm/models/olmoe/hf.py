"""OLMoE <-> Hugging Face `olmoe`: Llama names plus `self_attn.q_norm` / `k_norm` (full width), the
sparse MLP under `mlp` (router `gate`, experts gate_proj / up_proj / down_proj)."""

from __future__ import annotations

from typing import Any, ClassVar

from fastlm.config.errors import ConfigIssue
from fastlm.models.hf_adapter import HFAdapter, Reader, WeightRule
from fastlm.models.llama.hf import SILU_ACTIVATIONS, llama_like_fields, llama_like_to_hf
from fastlm.models.mixtral.hf import attention_rules
from fastlm.models.moe_family import expert_rules, moe_settings
from fastlm.models.olmoe.config import OlmoeConfig


class OlmoeAdapter(HFAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("olmoe",)
    defaults: ClassVar[dict[str, dict[str, Any]]] = {
        "olmoe": {"hidden_act": "silu", "initializer_range": 0.02, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                  "attention_dropout": 0.0, "attention_bias": False, "clip_qkv": None, "head_dim": None,
                  "num_key_value_heads": None, "max_position_embeddings": 4096, "rope_theta": 10000.0,
                  "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False, "router_aux_loss_coef": 0.01},
    }
    embedding_key: ClassVar[str] = "model.embed_tokens.weight"

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

    def weight_rules(self, config: OlmoeConfig) -> list[WeightRule]:  # type: ignore[override]
        rules = [WeightRule("embeddings.tokens.weight", (self.embedding_key,))]
        for layer in range(config.num_layers):
            base, hf = f"blocks.{layer}", f"model.layers.{layer}"
            rules += attention_rules(config, layer, base, hf)
            rules += [WeightRule(f"{base}.attn.q_norm.weight", (f"{hf}.self_attn.q_norm.weight",)),
                      WeightRule(f"{base}.attn.k_norm.weight", (f"{hf}.self_attn.k_norm.weight",))]
            rules += expert_rules(config.moe, f"{base}.mlp", f"{hf}.mlp", ("gate_proj", "up_proj", "down_proj"),
                                  config.hidden_size)
        return rules + [WeightRule("final_norm.weight", ("model.norm.weight",))] + self.head_rule(config)
