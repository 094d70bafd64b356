"""Phi-3 <-> Hugging Face `phi3`. HF stores q/k/v as one `qkv_proj` (q rows, then k, then v) and the MLP
as one `gate_up_proj` (gate rows, then up): our layout, copied as is. RoPE: plain or `longrope` (Phi-3.5 and
the 128k models: per-frequency short and long factors, switched by the forward's largest position), as
transformers' Phi-3 reads them: `su` and `yarn` mean longrope there, and the top-level
`original_max_position_embeddings` (default 4096) is the pretraining context. Phi-4-mini turns the first
`partial_rotary_factor` (0.75) of each head."""

from __future__ import annotations

from typing import Any, ClassVar

from fastlm.config.errors import ConfigIssue
from fastlm.models.hf_adapter import Reader, WeightRule, rope_parameters
from fastlm.models.llama.hf import (
    COMMON_DEFAULTS,
    SILU_ACTIVATIONS,
    LlamaAdapter,
    llama_like_fields,
    llama_like_to_hf,
)
from fastlm.models.phi3.config import Phi3Config


class Phi3Adapter(LlamaAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("phi3",)
    defaults: ClassVar[dict[str, dict[str, Any]]] = {"phi3": {
        **COMMON_DEFAULTS, "num_key_value_heads": None, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "sliding_window": None, "original_max_position_embeddings": 4096}}

    def fields(self, reader: Reader, model_type: str) -> dict[str, Any]:
        parameters, key = rope_parameters(reader)
        partial = parameters.pop("partial_rotary_factor", reader.hf.get("partial_rotary_factor", 1.0))
        outer, reader = reader, Reader({**reader.hf, "partial_rotary_factor": 1.0}, reader.defaults, reader.source)
        if parameters["rope_type"] in ("su", "yarn"):
            parameters["rope_type"] = "longrope"  # transformers' Phi-3 reads both as longrope
        if parameters["rope_type"] not in ("default", "longrope"):
            reader.fail(f"{key}.rope_type", "transformers' Phi-3 takes default or longrope RoPE", parameters["rope_type"])
        parameters["original_max_position_embeddings"] = reader.get("original_max_position_embeddings")  # wins there
        fields = llama_like_fields(reader, (parameters, key))
        reader.expect("hidden_act", SILU_ACTIVATIONS, "the MLP is SwiGLU")
        for key in ("resid_pdrop", "embd_pdrop"):
            reader.expect(key, (0, 0.0), "fastlm has one model.dropout, and it also drops attention")
        hidden, heads = fields["hidden_size"], fields["num_heads"]
        if reader.hf.get("head_dim") is None and isinstance(hidden, int) and isinstance(heads, int) and heads:
            fields["head_dim"] = hidden // heads  # Phi-3 derives it
        width = int(fields.get("head_dim") or 0) * partial if isinstance(partial, (int, float)) else None
        if width is None or int(width) < 2 or int(width) % 2:
            outer.fail("partial_rotary_factor", f"RoPE would turn {width:g} dims of each head: it needs a positive "
                       "even number", partial)
        sliding_window = reader.get("sliding_window")
        outer.issues += reader.issues  # the shared RoPE reader refuses partial rotary; Phi-3 takes it above
        return {"type": "phi3", **fields, "sliding_window": sliding_window, "layer_types": None,
                "partial_rotary_factor": partial}

    def export_issues(self, config: Phi3Config) -> list[ConfigIssue]:  # type: ignore[override]
        issues = []
        if config.dropout:
            issues.append(ConfigIssue("model.dropout", "HF Phi-3's dropouts differ from fastlm's single one",
                                      config.dropout, hint="set model.dropout: 0.0"))
        if config.rope_scaling is not None and config.rope_scaling.type != "longrope":
            issues.append(ConfigIssue("model.rope_scaling.type", "transformers' Phi-3 takes default or longrope RoPE",
                                      config.rope_scaling.type))
        return issues

    def to_hf(self, config: Phi3Config) -> dict[str, Any]:  # type: ignore[override]
        hf = llama_like_to_hf(config)
        hf.pop("head_dim")
        hf["rope_parameters"] = {**hf["rope_parameters"], "partial_rotary_factor": config.partial_rotary_factor}
        return {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], **hf, "resid_pdrop": 0.0,
                "embd_pdrop": 0.0, "original_max_position_embeddings": (config.rope_scaling.original_max_seq_len
                                                                        if config.rope_scaling else config.max_seq_len),
                "sliding_window": config.sliding_window, "partial_rotary_factor": config.partial_rotary_factor}

    def layer_rules(self, config: Phi3Config, layer: int, base: str, hf: str) -> list[WeightRule]:  # type: ignore[override]
        return [WeightRule(f"{base}.{ours}", (f"{hf}.{theirs}",)) for ours, theirs in (
            ("attn_norm.weight", "input_layernorm.weight"), ("attn.qkv_proj.weight", "self_attn.qkv_proj.weight"),
            ("attn.out_proj.weight", "self_attn.o_proj.weight"), ("mlp_norm.weight", "post_attention_layernorm.weight"),
            ("mlp.gate_up_proj.weight", "mlp.gate_up_proj.weight"), ("mlp.down_proj.weight", "mlp.down_proj.weight"))]
