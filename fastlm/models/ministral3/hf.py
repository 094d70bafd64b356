"""Ministral 3 <-> Hugging Face `ministral3`: the Mistral layout and names; RoPE from `rope_parameters`
(yarn with mscale / mscale_all_dim in the published configs) whose `llama_4_scaling_beta` and
`original_max_position_embeddings` set the query scale (transformers requires both)."""

from __future__ import annotations

from typing import Any, ClassVar

from fastlm.models.hf_adapter import Reader, rope_parameters, rope_to_hf
from fastlm.models.llama.hf import COMMON_DEFAULTS, llama_like_to_hf
from fastlm.models.ministral.hf import MinistralAdapter
from fastlm.models.ministral3.config import Ministral3Config

_DEFAULT_ROPE = {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 16.0,
                 "original_max_position_embeddings": 16384, "beta_fast": 32.0, "beta_slow": 1.0,
                 "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}


class Ministral3Adapter(MinistralAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("ministral3",)
    defaults: ClassVar[dict[str, dict[str, Any]]] = {"ministral3": {
        **COMMON_DEFAULTS, "num_key_value_heads": 8, "head_dim": None, "max_position_embeddings": 262144,
        "sliding_window": None, "rope_parameters": _DEFAULT_ROPE}}

    def fields(self, reader: Reader, model_type: str) -> dict[str, Any]:
        if not reader.hf.get("rope_parameters") and not reader.hf.get("rope_scaling"):  # transformers' default
            reader = Reader({**reader.hf, "rope_parameters": _DEFAULT_ROPE}, reader.defaults, reader.source)
        fields = super().fields(reader, model_type)
        parameters, key = rope_parameters(reader)
        beta, period = parameters.get("llama_4_scaling_beta"), parameters.get("original_max_position_embeddings")
        if not isinstance(beta, (int, float)) or not isinstance(period, int):
            reader.fail(f"{key}.llama_4_scaling_beta", "Ministral 3 needs llama_4_scaling_beta and "
                        "original_max_position_embeddings in its RoPE parameters", {"beta": beta, "period": period})
        hidden, heads = fields["hidden_size"], fields["num_heads"]
        if fields.get("head_dim") is None and isinstance(hidden, int) and isinstance(heads, int) and heads:
            fields["head_dim"] = hidden // heads
        return {**fields, "layer_types": None, "query_scale_beta": beta, "query_scale_period": period}

    def to_hf(self, config: Ministral3Config) -> dict[str, Any]:  # type: ignore[override]
        hf = llama_like_to_hf(config)
        hf.pop("rope_scaling", None)
        hf.pop("rope_theta")
        rope = {**rope_to_hf(config.rope_theta, config.rope_scaling), "llama_4_scaling_beta": config.query_scale_beta}
        rope.setdefault("original_max_position_embeddings", config.query_scale_period)
        return {"model_type": "ministral3", "architectures": ["Ministral3ForCausalLM"], **hf, "rope_parameters": rope,
                "sliding_window": config.sliding_window}
