"""GLM-4 <-> Hugging Face `glm4`: q/k/v projections (with biases) and o_proj, the MLP's fused `gate_up_proj`
(gate rows, then up), four norms per layer (input_layernorm, post_self_attn_layernorm,
post_attention_layernorm before the MLP, post_mlp_layernorm), `partial_rotary_factor` (default 0.5).

GLM rotates interleaved pairs (dims 2j, 2j+1) of each head's first R dims; fastlm's RoPE rotates the half
split (j, R/2 + j). The q and k rows (weights and biases) are reordered on import, per head, to even
dims then odd dims of the rotary part (the rest unchanged), and back on export: q.k is the same sum in
another order, so the logits are equal."""

from __future__ import annotations

from typing import Any, ClassVar

from fastlm.config.errors import ConfigIssue
from fastlm.models.glm4.config import Glm4Config
from fastlm.models.hf_adapter import Reader, WeightRule
from fastlm.models.llama.hf import COMMON_DEFAULTS, SILU_ACTIVATIONS, LlamaAdapter, llama_like_fields, llama_like_to_hf


def half_split_rows(heads: int, head_dim: int, rotary_dims: int) -> list[int]:
    """The checkpoint row of each of our rows of `heads` heads: per head, the rotary part's even dims, then
    its odd dims, then the dims RoPE leaves alone."""
    within = [*range(0, rotary_dims, 2), *range(1, rotary_dims, 2), *range(rotary_dims, head_dim)]
    return [head * head_dim + dim for head in range(heads) for dim in within]


class Glm4Adapter(LlamaAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("glm4",)
    defaults: ClassVar[dict[str, dict[str, Any]]] = {"glm4": {
        **COMMON_DEFAULTS, "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 131072,
        "rms_norm_eps": 1.5625e-07, "attention_bias": True, "partial_rotary_factor": 0.5}}

    def fields(self, reader: Reader, model_type: str) -> dict[str, Any]:
        hf = reader.hf
        parameters = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
        partial = parameters.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
        full_rotary = Reader({**hf, "partial_rotary_factor": 1.0,
                              "rope_parameters": {**parameters, "partial_rotary_factor": 1.0}} if parameters
                             else {**hf, "partial_rotary_factor": 1.0}, reader.defaults, reader.source)
        fields = llama_like_fields(full_rotary)  # the shared RoPE reader refuses partial rotary; GLM-4 takes it here
        reader.issues += full_rotary.issues
        reader.expect("hidden_act", SILU_ACTIVATIONS, "the MLP is SwiGLU")
        return {"type": "glm4", **fields, "qkv_bias": reader.get("attention_bias"), "partial_rotary_factor": partial,
                "sliding_window": None, "layer_types": None}

    def export_issues(self, config: Glm4Config) -> list[ConfigIssue]:  # type: ignore[override]
        issues = []
        if config.dropout:
            issues.append(ConfigIssue("model.dropout", "HF GLM-4 has attention dropout only", config.dropout,
                                      hint="set model.dropout: 0.0"))
        if config.sliding_window is not None:
            issues.append(ConfigIssue("model.sliding_window", "HF GLM-4 has no sliding window", config.sliding_window))
        return issues

    def to_hf(self, config: Glm4Config) -> dict[str, Any]:  # type: ignore[override]
        hf = llama_like_to_hf(config)
        hf["rope_parameters"] = {**hf["rope_parameters"], "partial_rotary_factor": config.partial_rotary_factor}
        return {"model_type": "glm4", "architectures": ["Glm4ForCausalLM"], **hf, "attention_bias": config.qkv_bias,
                "partial_rotary_factor": config.partial_rotary_factor}

    def layer_rules(self, config: Glm4Config, layer: int, base: str, hf: str) -> list[WeightRule]:  # type: ignore[override]
        head_dim, dims = config.head_dim or 0, config.rotary_dims
        q_rows = half_split_rows(config.num_heads, head_dim, dims)
        k_rows = [len(q_rows) + row for row in half_split_rows(config.kv_heads, head_dim, dims)]
        v_start = len(q_rows) + len(k_rows)
        rows = tuple(q_rows + k_rows + list(range(v_start, v_start + config.kv_heads * head_dim)))
        q_size, kv_size = len(q_rows), len(k_rows)
        projections = tuple(f"{hf}.self_attn.{name}_proj" for name in "qkv")
        sizes = (q_size, kv_size, kv_size)
        rules = [WeightRule(f"{base}.attn.qkv_proj.weight", tuple(f"{p}.weight" for p in projections), sizes, rows=rows)]
        if config.qkv_bias:
            rules.append(WeightRule(f"{base}.attn.qkv_proj.bias", tuple(f"{p}.bias" for p in projections), sizes,
                                    rows=rows))
        names = (("attn_norm", "input_layernorm"), ("post_attn_norm", "post_self_attn_layernorm"),
                 ("mlp_norm", "post_attention_layernorm"), ("post_mlp_norm", "post_mlp_layernorm"),
                 ("attn.out_proj", "self_attn.o_proj"), ("mlp.gate_up_proj", "mlp.gate_up_proj"),
                 ("mlp.down_proj", "mlp.down_proj"))
        return rules + [WeightRule(f"{base}.{ours}.weight", (f"{hf}.{theirs}.weight",)) for ours, theirs in names]
