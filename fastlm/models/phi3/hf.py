"""Phi-3 <-> Hugging Face `phi3`. HF stores q/k/v as one `qkv_proj` (q rows, then k, then v) and the MLP
as one `gate_up_proj` (gate rows, then up): our layout, copied as is. RoPE: plain, linear, llama3 or
yarn; Phi-3's `longrope` (the 128k models: per-dimension factors switched by sequence length) is refused."""

from __future__ import annotations

from typing import Any, ClassVar

from fastlm.config.errors import ConfigIssue
from fastlm.models.hf_adapter import Reader, WeightRule
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
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "sliding_window": None}}

    def fields(self, reader: Reader, model_type: str) -> dict[str, Any]:
        fields = llama_like_fields(reader)
        reader.expect("hidden_act", SILU_ACTIVATIONS, "the MLP is SwiGLU")
        for key in ("resid_pdrop", "embd_pdrop"):
            reader.expect(key, (0, 0.0), "fastlm has one model.dropout, and it also drops attention")
        hidden, heads = fields["hidden_size"], fields["num_heads"]
        if reader.hf.get("head_dim") is None and isinstance(hidden, int) and isinstance(heads, int) and heads:
            fields["head_dim"] = hidden // heads  # Phi-3 derives it
        return {"type": "phi3", **fields, "sliding_window": reader.get("sliding_window"), "layer_types": None}

    def export_issues(self, config: Phi3Config) -> list[ConfigIssue]:  # type: ignore[override]
        if config.dropout:
            return [ConfigIssue("model.dropout", "HF Phi-3's dropouts differ from fastlm's single one",
                                config.dropout, hint="set model.dropout: 0.0")]
        return []

    def to_hf(self, config: Phi3Config) -> dict[str, Any]:  # type: ignore[override]
        hf = llama_like_to_hf(config)
        hf.pop("head_dim")
        return {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], **hf, "resid_pdrop": 0.0,
                "embd_pdrop": 0.0, "original_max_position_embeddings": config.max_seq_len,
                "sliding_window": config.sliding_window}

    def layer_rules(self, config: Phi3Config, layer: int, base: str, hf: str) -> list[WeightRule]:  # type: ignore[override]
        return [WeightRule(f"{base}.{ours}", (f"{hf}.{theirs}",)) for ours, theirs in (
            ("attn_norm.weight", "input_layernorm.weight"), ("attn.qkv_proj.weight", "self_attn.qkv_proj.weight"),
            ("attn.out_proj.weight", "self_attn.o_proj.weight"), ("mlp_norm.weight", "post_attention_layernorm.weight"),
            ("mlp.gate_up_proj.weight", "mlp.gate_up_proj.weight"), ("mlp.down_proj.weight", "mlp.down_proj.weight"))]
