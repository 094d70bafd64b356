"""Llama family <-> Hugging Face `llama`, `qwen2` (= llama + q/k/v biases, per-layer windows through
`layer_types` / `max_window_layers`) and `mistral` (= llama + one sliding window). Our fused qkv (q, k, v
rows) and gate_up (gate, up rows) are HF's separate projections concatenated; RoPE uses HF's half split,
so q/k weights are copied as they are."""

from __future__ import annotations

from typing import Any, ClassVar

from fastlm.config.errors import ConfigIssue
from fastlm.models.hf_adapter import (
    FULL,
    SLIDING,
    HFAdapter,
    Reader,
    WeightRule,
    layer_types,
    rope_fields,
    rope_parameters,
    rope_to_hf,
)
from fastlm.models.llama.config import LlamaConfig

SILU_ACTIVATIONS = ("silu", "swish")
COMMON_DEFAULTS = {"hidden_act": "silu", "initializer_range": 0.02, "rms_norm_eps": 1e-6,
                    "tie_word_embeddings": False, "attention_dropout": 0.0, "head_dim": None}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
# our model fields -> the config.json keys every Llama-like family names the same way
LLAMA_LIKE_FIELDS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
    "intermediate_size": "intermediate_size", "max_seq_len": "max_position_embeddings",
    "norm_eps": "rms_norm_eps", "init_std": "initializer_range", "tie_embeddings": "tie_word_embeddings",
}


def llama_like_fields(reader: Reader, rope: tuple[dict[str, Any], str] | None = None) -> dict[str, Any]:
    """The fields every Llama-like config.json has, and the checks they share (SiLU, no attention dropout,
    RoPE parameters (`rope`: a family's own reading of them, else `rope_parameters(reader)`), head_dim)."""
    fields = reader.fields(LLAMA_LIKE_FIELDS)
    reader.expect("attention_dropout", (0, 0.0), "model.dropout would also drop residual branches")
    fields["rope_theta"], fields["rope_scaling"] = rope_fields(reader, *(rope or rope_parameters(reader)),
                                                               fields["max_seq_len"])
    return {**fields, "dropout": 0.0}


def llama_like_to_hf(config: LlamaConfig) -> dict[str, Any]:
    """The HF keys of a Llama-like config (both RoPE spellings: transformers 5 and 4.x)."""
    rope = rope_to_hf(config.rope_theta, config.rope_scaling)
    legacy = {} if config.rope_scaling is None else {"rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"}}
    return {"hidden_size": config.hidden_size, "intermediate_size": config.ffn_size,
            "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.kv_heads, "head_dim": config.head_dim, "hidden_act": "silu",
            "max_position_embeddings": config.max_seq_len, "rms_norm_eps": config.norm_eps,
            "attention_dropout": 0.0, "rope_theta": config.rope_theta, "rope_parameters": rope, **legacy}


def window_fields(reader: Reader, window: Any, num_layers: Any, max_window_layers: int | None = None,
                  uniform_only: bool = False) -> dict[str, Any]:
    """Our sliding_window + layer_types from HF's window and per-layer kinds (None when all layers agree)."""
    kinds = layer_types(reader, window, num_layers, max_window_layers)
    if kinds is None or set(kinds) == {SLIDING}:
        return {"sliding_window": window, "layer_types": None}
    if set(kinds) == {FULL}:
        return {"sliding_window": None, "layer_types": None}
    if uniform_only:
        reader.fail("layer_types", "this architecture applies one attention pattern to every layer", kinds,
                    "use the same attention type for all layers")
    if window is None:
        reader.fail("sliding_window", "layer_types has sliding layers but no window is set", window)
    return {"sliding_window": window, "layer_types": kinds}


def layer_types_to_hf(config: LlamaConfig) -> list[str]:
    return [SLIDING if config.is_sliding(layer) else FULL for layer in range(config.num_layers)]


def split_rules(config: LlamaConfig, layer: int, base: str, hf: str) -> list[WeightRule]:
    """q/k/v and gate/up as HF's separate projections (Llama, Qwen, Mistral, Gemma)."""
    q_size, kv_size, ffn = config.num_heads * config.head_dim, config.kv_heads * config.head_dim, config.ffn_size
    qkv = tuple(f"{hf}.self_attn.{name}_proj" for name in "qkv")
    rules = [WeightRule(f"{base}.attn.qkv_proj.weight", tuple(f"{p}.weight" for p in qkv), (q_size, kv_size, kv_size))]
    if config.qkv_bias:
        rules.append(WeightRule(f"{base}.attn.qkv_proj.bias", tuple(f"{p}.bias" for p in qkv), (q_size, kv_size, kv_size)))
    return rules + [WeightRule(f"{base}.attn.out_proj.weight", (f"{hf}.self_attn.o_proj.weight",)),
                    WeightRule(f"{base}.mlp.gate_up_proj.weight",
                               (f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight"), (ffn, ffn)),
                    WeightRule(f"{base}.mlp.down_proj.weight", (f"{hf}.mlp.down_proj.weight",))]


class LlamaAdapter(HFAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("llama", "qwen2", "mistral")
    defaults: ClassVar[dict[str, dict[str, Any]]] = {
        "llama": {**COMMON_DEFAULTS, "num_key_value_heads": None, "max_position_embeddings": 2048,
                  "attention_bias": False, "mlp_bias": False},
        "qwen2": {**COMMON_DEFAULTS, "num_key_value_heads": 32, "max_position_embeddings": 32768,
                  "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "layer_types": None},
        "mistral": {**COMMON_DEFAULTS, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
                    "sliding_window": 4096, "layer_types": None},
    }
    embedding_key: ClassVar[str] = "model.embed_tokens.weight"

    def fields(self, reader: Reader, model_type: str) -> dict[str, Any]:
        fields = llama_like_fields(reader)
        reader.expect("hidden_act", SILU_ACTIVATIONS, "the MLP is SwiGLU")
        if model_type == "llama":
            reader.expect("attention_bias", (False,), "Llama blocks here have no q/k/v/o biases; Qwen2 has q/k/v only")
            reader.expect("mlp_bias", (False,), "the SwiGLU MLP has no biases")
            windows = {"sliding_window": None, "layer_types": None}
        elif model_type == "qwen2":
            window = reader.get("sliding_window") if reader.get("use_sliding_window") else None
            windows = window_fields(reader, window, fields["num_layers"], reader.get("max_window_layers"))
        else:
            windows = window_fields(reader, reader.get("sliding_window"), fields["num_layers"], uniform_only=True)
        return {"type": "llama", **fields, **windows, "qkv_bias": model_type == "qwen2"}

    @staticmethod
    def model_type(config: LlamaConfig) -> str:
        """qwen2 with qkv biases, mistral with a sliding window, else llama."""
        if config.qkv_bias:
            return "qwen2"
        return "mistral" if config.sliding_window else "llama"

    def export_issues(self, config: LlamaConfig) -> list[ConfigIssue]:  # type: ignore[override]
        issues = []
        if config.dropout:
            issues.append(ConfigIssue("model.dropout", "HF Llama-family models have attention dropout only",
                                      config.dropout, hint="set model.dropout: 0.0"))
        mixed = len({config.is_sliding(layer) for layer in range(config.num_layers)}) > 1
        if mixed and not config.qkv_bias:
            issues.append(ConfigIssue("model.layer_types", "HF Llama and Mistral apply one attention pattern to every "
                                      "layer (Qwen2, which mixes them, has q/k/v biases)", config.layer_types))
        return issues

    def to_hf(self, config: LlamaConfig) -> dict[str, Any]:  # type: ignore[override]
        model_type = self.model_type(config)
        hf = {"model_type": model_type, "architectures": [ARCHITECTURES[model_type]], **llama_like_to_hf(config)}
        if model_type == "llama":
            return {**hf, "attention_bias": False, "mlp_bias": False}
        if model_type == "mistral":
            return {**hf, "sliding_window": config.sliding_window}
        window = config.sliding_window
        return {**hf, "use_sliding_window": window is not None, "sliding_window": window,
                "max_window_layers": config.num_layers if window is None else 0,
                "layer_types": layer_types_to_hf(config)}

    def weight_rules(self, config: LlamaConfig) -> list[WeightRule]:  # type: ignore[override]
        rules = [WeightRule("embeddings.tokens.weight", (self.embedding_key,))]
        for layer in range(config.num_layers):
            rules += self.layer_rules(config, layer, f"blocks.{layer}", f"model.layers.{layer}")
        return rules + [WeightRule("final_norm.weight", ("model.norm.weight",))] + self.head_rule(config)

    def layer_rules(self, config: LlamaConfig, layer: int, base: str, hf: str) -> list[WeightRule]:
        """One block's tensors (families built on Llama extend or replace this)."""
        return [WeightRule(f"{base}.attn_norm.weight", (f"{hf}.input_layernorm.weight",)),
                WeightRule(f"{base}.mlp_norm.weight", (f"{hf}.post_attention_layernorm.weight",)),
                *split_rules(config, layer, base, hf)]
