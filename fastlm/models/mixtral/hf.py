"""Mixtral <-> Hugging Face `mixtral`: Mistral's attention names, the sparse MLP under
`block_sparse_moe` (router `gate`, experts w1 = gate, w3 = up, w2 = down), top-k always renormalised."""

from __future__ import annotations

from typing import Any, ClassVar

from fastlm.config.errors import ConfigIssue
from fastlm.models.hf_adapter import Reader, WeightRule
from fastlm.models.llama.hf import SILU_ACTIVATIONS, LlamaAdapter, llama_like_fields, llama_like_to_hf, window_fields
from fastlm.models.mixtral.config import MixtralConfig
from fastlm.models.moe_family import moe_settings, sparse_layer_rules


class MixtralAdapter(LlamaAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("mixtral",)
    defaults: ClassVar[dict[str, dict[str, Any]]] = {
        "mixtral": {"hidden_act": "silu", "initializer_range": 0.02, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                    "attention_dropout": 0.0, "head_dim": None, "num_key_value_heads": 8,
                    "max_position_embeddings": 4096 * 32, "sliding_window": None, "layer_types": None,
                    "rope_theta": 1e6, "num_local_experts": 8, "num_experts_per_tok": 2,
                    "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0},
    }

    def fields(self, reader: Reader, model_type: str) -> dict[str, Any]:
        fields = llama_like_fields(reader)
        reader.expect("hidden_act", SILU_ACTIVATIONS, "the experts are SwiGLU")
        reader.expect("router_jitter_noise", (0, 0.0), "fastlm's router takes no input jitter")
        moe = moe_settings(reader, ("num_local_experts",), "intermediate_size", True)
        windows = window_fields(reader, reader.get("sliding_window"), fields["num_layers"], uniform_only=True)
        return {"type": "mixtral", **fields, "intermediate_size": None, **windows, "moe": moe}

    def export_issues(self, config: MixtralConfig) -> list[ConfigIssue]:  # type: ignore[override]
        issues = []
        if not config.moe.normalize_top_k:
            issues.append(ConfigIssue("model.moe.normalize_top_k", "HF Mixtral always renormalises the top-k",
                                      False, hint="set model.moe.normalize_top_k: true"))
        if config.qkv_bias or config.dropout or config.layer_types is not None:
            issues.append(ConfigIssue("model", "HF Mixtral has no q/k/v biases, dropout or per-layer windows",
                                      None, hint="set qkv_bias: false, dropout: 0.0, layer_types: null"))
        return issues

    def to_hf(self, config: MixtralConfig) -> dict[str, Any]:  # type: ignore[override]
        return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], **llama_like_to_hf(config),
                "sliding_window": config.sliding_window, "num_local_experts": config.moe.num_experts,
                "router_jitter_noise": 0.0, **config.moe.hf_fields()}

    def layer_rules(self, config: MixtralConfig, layer: int, base: str, hf: str) -> list[WeightRule]:  # type: ignore[override]
        return sparse_layer_rules(super().layer_rules(config, layer, base, hf), config.moe, base,
                                  f"{hf}.block_sparse_moe", ("w1", "w3", "w2"), config.hidden_size)
