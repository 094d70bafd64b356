"""GPT-2 <-> Hugging Face `gpt2`. GPT-2's Conv1D stores (in, out), the transpose of our nn.Linear weights."""

from __future__ import annotations

from typing import Any, ClassVar

from fastlm.models.gpt2.config import GPT2Config
from fastlm.models.hf_adapter import HFAdapter, Reader, WeightRule

_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both are the tanh GELU our GeluMLP uses


class GPT2Adapter(HFAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("gpt2",)
    defaults: ClassVar[dict[str, dict[str, Any]]] = {"gpt2": {
        "n_inner": None, "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1,
        "attn_pdrop": 0.1, "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "n_positions": 1024,
        "tie_word_embeddings": True, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "add_cross_attention": False}}
    embedding_key: ClassVar[str] = "transformer.wte.weight"
    # GPT-2's causal-mask buffers, saved by some older checkpoints
    ignored_suffixes: ClassVar[tuple[str, ...]] = (".attn.bias", ".attn.masked_bias")

    def fields(self, reader: Reader, model_type: str) -> dict[str, Any]:
        fields = reader.fields({
            "vocab_size": "vocab_size", "hidden_size": "n_embd", "num_layers": "n_layer", "num_heads": "n_head",
            "max_seq_len": "n_positions", "intermediate_size": "n_inner", "norm_eps": "layer_norm_epsilon",
            "init_std": "initializer_range", "tie_embeddings": "tie_word_embeddings",
        })
        reader.expect("activation_function", _ACTIVATIONS, "GPT-2 blocks here use the tanh GELU")
        reader.expect("scale_attn_weights", (True,), "attention is always scaled by 1/sqrt(head_dim)")
        reader.expect("scale_attn_by_inverse_layer_idx", (False,), "no per-layer attention scaling")
        reader.expect("add_cross_attention", (False,), "decoder-only, no cross-attention")
        # reorder_and_upcast_attn is accepted: it only changes mixed-precision rounding, not the math
        rates = {key: reader.get(key) for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
        if len(set(rates.values())) > 1:
            reader.fail("attn_pdrop", "fastlm has one model.dropout for embeddings, residuals and attention",
                        rates, "set resid_pdrop, embd_pdrop and attn_pdrop to the same value")
        return {"type": "gpt2", **fields, "dropout": rates["resid_pdrop"]}

    def to_hf(self, config: GPT2Config) -> dict[str, Any]:  # type: ignore[override]
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": config.hidden_size,
                "n_layer": config.num_layers, "n_head": config.num_heads, "n_positions": config.max_seq_len,
                "n_inner": config.ffn_size, "activation_function": "gelu_new", "layer_norm_epsilon": config.norm_eps,
                "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False, "add_cross_attention": False}

    def weight_rules(self, config: GPT2Config) -> list[WeightRule]:  # type: ignore[override]
        rules = [WeightRule("embeddings.tokens.weight", (self.embedding_key,)),
                 WeightRule("embeddings.positions.weight", ("transformer.wpe.weight",))]
        pairs = (("attn_norm", "ln_1", False), ("attn.qkv_proj", "attn.c_attn", True),
                 ("attn.out_proj", "attn.c_proj", True), ("mlp_norm", "ln_2", False),
                 ("mlp.up_proj", "mlp.c_fc", True), ("mlp.down_proj", "mlp.c_proj", True))
        for layer in range(config.num_layers):
            for ours, theirs, conv1d in pairs:
                base, hf = f"blocks.{layer}.{ours}", f"transformer.h.{layer}.{theirs}"
                rules.append(WeightRule(f"{base}.weight", (f"{hf}.weight",), transpose=conv1d))
                rules.append(WeightRule(f"{base}.bias", (f"{hf}.bias",)))
        rules += [WeightRule("final_norm.weight", ("transformer.ln_f.weight",)),
                  WeightRule("final_norm.bias", ("transformer.ln_f.bias",))]
        return rules + self.head_rule(config)

    def normalise_keys(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Original GPT-2 checkpoints name the base model's tensors without the `transformer.` prefix."""
        if not any(key.startswith("transformer.") for key in tensors):
            return {key if key == "lm_head.weight" else f"transformer.{key}": value for key, value in tensors.items()}
        return tensors
