"""DeepSeek-V3 <-> Hugging Face `deepseek_v3` (DeepseekV3ForCausalLM). Names: `self_attn.{q_proj | q_a_proj,
q_a_layernorm, q_b_proj}`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`; dense layers' `mlp.{gate,
up,down}_proj`; sparse layers' router `mlp.gate` (weight and `e_score_correction_bias`), experts
`mlp.experts.{e}.{gate,up,down}_proj` and `mlp.shared_experts.{gate,up,down}_proj`.

Multi-token-prediction layers (`num_nextn_predict_layers`: DeepSeek-V3's layer 61, the layers holding
`eh_proj` / `enorm` / `hnorm`) are dropped at import, as transformers drops them: they serve speculative
decoding and an auxiliary training loss, not the next-token logits; an export writes none
(num_nextn_predict_layers 0). The router's `scoring_func` must be sigmoid and `topk_method` noaux_tc (what
transformers computes); attention biases are refused."""

from __future__ import annotations

import re
from typing import Any, ClassVar

from fastlm.config.errors import ConfigIssue
from fastlm.models.deepseek_v3.config import DeepseekV3Config
from fastlm.models.hf_adapter import HFAdapter, Reader, WeightRule, rope_fields, rope_parameters, rope_to_hf

DEFAULTS = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu",
    "max_position_embeddings": 4096, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_interleave": True, "attention_bias": False, "attention_dropout": 0.0, "rope_theta": 10000.0,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc"}
FIELDS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
          "num_heads": "num_attention_heads", "max_seq_len": "max_position_embeddings", "norm_eps": "rms_norm_eps",
          "init_std": "initializer_range", "tie_embeddings": "tie_word_embeddings", "q_lora_rank": "q_lora_rank",
          "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
          "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim", "intermediate_size": "intermediate_size",
          "first_k_dense_replace": "first_k_dense_replace", "rope_interleave": "rope_interleave"}
MOE_FIELDS = {"num_experts": "n_routed_experts", "top_k": "num_experts_per_tok", "ffn_size": "moe_intermediate_size",
              "normalize_top_k": "norm_topk_prob", "n_shared_experts": "n_shared_experts", "n_group": "n_group",
              "topk_group": "topk_group", "routed_scaling_factor": "routed_scaling_factor"}
_MTP_LAYER = re.compile(r"model\.layers\.(\d+)\.(eh_proj|enorm|hnorm|shared_head)\.")


class DeepseekV3Adapter(HFAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("deepseek_v3",)
    defaults: ClassVar[dict[str, dict[str, Any]]] = {"deepseek_v3": DEFAULTS}
    embedding_key: ClassVar[str] = "model.embed_tokens.weight"

    def fields(self, reader: Reader, model_type: str) -> dict[str, Any]:
        fields = reader.fields(FIELDS)
        reader.expect("hidden_act", ("silu", "swish"), "the MLPs and experts are SwiGLU")
        reader.expect("attention_bias", (False,), "the latent attention here has no projection biases")
        reader.expect("attention_dropout", (0, 0.0), "model.dropout would also drop residual branches")
        reader.expect("scoring_func", ("sigmoid",), "the router here is DeepSeek-V3's sigmoid router")
        reader.expect("topk_method", ("noaux_tc",), "the router here is DeepSeek-V3's group-limited noaux_tc top-k")
        heads = fields["num_heads"]
        reader.expect("num_key_value_heads", (heads,), "MLA expands its latent to every head (kv heads = heads)")
        fields["rope_theta"], fields["rope_scaling"] = rope_fields(reader, *rope_parameters(reader),
                                                                   fields["max_seq_len"])
        return {"type": "deepseek_v3", **fields, "moe": reader.fields(MOE_FIELDS), "dropout": 0.0}

    def normalise_keys(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """The multi-token-prediction layers left out (module docstring)."""
        mtp = {match.group(1) for name in tensors if (match := _MTP_LAYER.match(name))}
        return {name: value for name, value in tensors.items()
                if not any(name.startswith(f"model.layers.{layer}.") for layer in mtp)}

    def export_issues(self, config: DeepseekV3Config) -> list[ConfigIssue]:  # type: ignore[override]
        if config.dropout:
            return [ConfigIssue("model.dropout", "HF DeepSeek-V3 has attention dropout only", config.dropout,
                                hint="set model.dropout: 0.0")]
        return []

    def to_hf(self, config: DeepseekV3Config) -> dict[str, Any]:  # type: ignore[override]
        moe = config.moe
        return {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                **{theirs: getattr(config, ours) for ours, theirs in FIELDS.items()},
                **{theirs: getattr(moe, ours) for ours, theirs in MOE_FIELDS.items()},
                "num_key_value_heads": config.num_heads, "head_dim": config.qk_rope_head_dim, "hidden_act": "silu",
                "attention_bias": False, "attention_dropout": 0.0, "num_nextn_predict_layers": 0,
                "rope_parameters": rope_to_hf(config.rope_theta, config.rope_scaling)}

    def weight_rules(self, config: DeepseekV3Config) -> list[WeightRule]:  # type: ignore[override]
        rules = [WeightRule("embeddings.tokens.weight", (self.embedding_key,))]
        for layer in range(config.num_layers):
            rules += self.layer_rules(config, layer, f"blocks.{layer}", f"model.layers.{layer}")
        return rules + [WeightRule("final_norm.weight", ("model.norm.weight",))] + self.head_rule(config)

    def layer_rules(self, config: DeepseekV3Config, layer: int, base: str, hf: str) -> list[WeightRule]:
        attention = ["kv_a_proj", "kv_a_proj_with_mqa"], ["kv_a_norm", "kv_a_layernorm"], ["kv_b_proj", "kv_b_proj"], \
            ["out_proj", "o_proj"]
        queries = [["q_proj", "q_proj"]] if config.q_lora_rank is None else \
            [["q_a_proj", "q_a_proj"], ["q_a_norm", "q_a_layernorm"], ["q_b_proj", "q_b_proj"]]
        rules = [WeightRule(f"{base}.attn_norm.weight", (f"{hf}.input_layernorm.weight",)),
                 WeightRule(f"{base}.mlp_norm.weight", (f"{hf}.post_attention_layernorm.weight",)),
                 *(WeightRule(f"{base}.attn.{ours}.weight", (f"{hf}.self_attn.{theirs}.weight",))
                   for ours, theirs in (*queries, *attention))]
        if not config.is_sparse(layer):
            return rules + _swiglu_rules(f"{base}.mlp", f"{hf}.mlp", config.ffn_size)
        moe, ours, theirs = config.moe, f"{base}.mlp", f"{hf}.mlp"
        experts = range(moe.num_experts)
        gate_up = tuple(f"{theirs}.experts.{e}.{name}.weight" for e in experts for name in ("gate_proj", "up_proj"))
        return rules + [
            WeightRule(f"{ours}.routed.router.weight", (f"{theirs}.gate.weight",)),
            WeightRule(f"{ours}.routed.e_score_correction_bias", (f"{theirs}.gate.e_score_correction_bias",)),
            WeightRule(f"{ours}.routed.gate_up_proj", gate_up, (moe.ffn_size,) * len(gate_up)),
            WeightRule(f"{ours}.routed.down_proj", tuple(f"{theirs}.experts.{e}.down_proj.weight" for e in experts),
                       (config.hidden_size,) * moe.num_experts),
            *_swiglu_rules(f"{ours}.shared", f"{theirs}.shared_experts", moe.n_shared_experts * moe.ffn_size)]


def _swiglu_rules(ours: str, theirs: str, width: int) -> list[WeightRule]:
    """A `GatedMLP` (fused gate_up rows: gate, then up) from HF's gate_proj / up_proj / down_proj."""
    return [WeightRule(f"{ours}.gate_up_proj.weight", (f"{theirs}.gate_proj.weight", f"{theirs}.up_proj.weight"),
                       (width, width)),
            WeightRule(f"{ours}.down_proj.weight", (f"{theirs}.down_proj.weight",))]
