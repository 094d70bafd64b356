"""GPT-OSS <-> Hugging Face `gpt_oss`: Llama names with q/k/v/o biases and `self_attn.sinks`, the router
(`mlp.router.weight` / `.bias`) and the experts as four stacked tensors: `gate_up_proj` (E, H, 2F) with gate
and up columns interleaved, its bias (E, 2F), `down_proj` (E, F, H), its bias (E, H). Import reshapes them
to fastlm's row stacks (per expert its gate rows, then its up rows: `normalise_keys`), export back
(`checkpoint_layout`).

The published checkpoints (openai/gpt-oss-20b, -120b) store the experts' weights in MXFP4
(`quantization_config.quant_method: mxfp4`; `*_blocks`: two FP4 (e2m1) values a byte, 32 to a block,
`*_scales`: the block's power-of-two exponent + 127): they are dequantised to bf16 at import (exact: each
value is an FP4 number times a power of two), then trained and exported unquantised. Other quantisations are
refused, naming the dequantised route (a bf16 copy such as unsloth/gpt-oss-20b-BF16)."""

from __future__ import annotations

from typing import Any, ClassVar

from fastlm.config.errors import ConfigIssue
from fastlm.models.gpt_oss.config import GptOssConfig
from fastlm.models.hf_adapter import FULL, SLIDING, Reader, WeightRule, plausible_layers
from fastlm.models.llama.hf import COMMON_DEFAULTS, LlamaAdapter, layer_types_to_hf, llama_like_fields, llama_like_to_hf
from fastlm.models.llama.hf import split_rules as llama_split_rules

FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # by nibble
EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096, "rope_theta": 150_000.0}


class GptOssAdapter(LlamaAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("gpt_oss",)
    defaults: ClassVar[dict[str, dict[str, Any]]] = {"gpt_oss": {
        **COMMON_DEFAULTS, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "attention_bias": True, "sliding_window": 128, "layer_types": None,
        "num_local_experts": 128, "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
        "router_aux_loss_coef": 0.001, "rope_theta": 150_000.0, "quantization_config": None}}

    def fields(self, reader: Reader, model_type: str) -> dict[str, Any]:
        quantization = reader.get("quantization_config")
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        if quantization is not None and method != "mxfp4":  # MXFP4 is dequantised in `normalise_keys`
            reader.fail("quantization_config", f"a quantised ({method}) checkpoint: fastlm trains bf16/fp32 weights",
                        method, "use the dequantised bf16 variant (e.g. unsloth/gpt-oss-20b-BF16), or load it in "
                        "transformers with Mxfp4Config(dequantize=True) and save_pretrained that")
        if not reader.hf.get("rope_parameters") and not reader.hf.get("rope_scaling"):  # transformers' default
            reader = Reader({**reader.hf, "rope_parameters": _DEFAULT_ROPE}, reader.defaults, reader.source)
        fields = llama_like_fields(reader)
        reader.expect("attention_bias", (True,), "GPT-OSS here has q/k/v/o biases")
        num_layers = fields["num_layers"]
        kinds = reader.get("layer_types")
        if kinds is None and plausible_layers(reader, num_layers):  # transformers' default pattern
            kinds = [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
        if not isinstance(kinds, list) or not set(kinds) <= {SLIDING, FULL} or len(kinds) != num_layers:
            reader.fail("layer_types", f"must list {FULL!r} / {SLIDING!r} for each of the {num_layers} layers", kinds)
            kinds = None
        moe = {"num_experts": reader.get("num_local_experts"), "top_k": reader.get("num_experts_per_tok"),
               "ffn_size": reader.get("intermediate_size"), "aux_loss_coef": reader.get("router_aux_loss_coef"),
               "swiglu_alpha": reader.get("swiglu_alpha"), "swiglu_limit": reader.get("swiglu_limit")}
        return {"type": "gpt_oss", **fields, "intermediate_size": None, "qkv_bias": True, "moe": moe,
                "sliding_window": reader.get("sliding_window") if kinds and SLIDING in kinds else None,
                "layer_types": kinds if kinds and SLIDING in kinds else None}

    def export_issues(self, config: GptOssConfig) -> list[ConfigIssue]:  # type: ignore[override]
        issues = []
        if config.dropout:
            issues.append(ConfigIssue("model.dropout", "HF GPT-OSS has attention dropout only", config.dropout,
                                      hint="set model.dropout: 0.0"))
        if not config.qkv_bias:
            issues.append(ConfigIssue("model.qkv_bias", "HF GPT-OSS has q/k/v/o biases", False))
        return issues

    def to_hf(self, config: GptOssConfig) -> dict[str, Any]:  # type: ignore[override]
        hf = llama_like_to_hf(config)
        hf.pop("rope_scaling", None)
        moe = config.moe
        return {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], **hf, "intermediate_size": moe.ffn_size,
                "attention_bias": True, "sliding_window": config.sliding_window or 128,
                "layer_types": layer_types_to_hf(config), "num_local_experts": moe.num_experts,
                "num_experts_per_tok": moe.top_k, "swiglu_alpha": moe.swiglu_alpha, "swiglu_limit": moe.swiglu_limit,
                "router_aux_loss_coef": moe.aux_loss_coef, "output_router_logits": False}

    def layer_rules(self, config: GptOssConfig, layer: int, base: str, hf: str) -> list[WeightRule]:  # type: ignore[override]
        attention = [rule for rule in llama_split_rules(config, layer, base, hf) if ".attn." in rule.ours]
        names = (("attn_norm.weight", "input_layernorm.weight"), ("mlp_norm.weight", "post_attention_layernorm.weight"),
                 ("attn.out_proj.bias", "self_attn.o_proj.bias"), ("attn.sinks", "self_attn.sinks"),
                 ("mlp.router.weight", "mlp.router.weight"), ("mlp.router.bias", "mlp.router.bias"),
                 ("mlp.gate_up_proj", "mlp.experts.gate_up_proj"), ("mlp.gate_up_bias", "mlp.experts.gate_up_proj_bias"),
                 ("mlp.down_proj", "mlp.experts.down_proj"), ("mlp.down_bias", "mlp.experts.down_proj_bias"))
        return attention + [WeightRule(f"{base}.{ours}", (f"{hf}.{theirs}",)) for ours, theirs in names]

    def normalise_keys(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """The experts' stacked tensors as fastlm's row stacks, MXFP4 ones dequantised first (see the module
        docstring)."""
        import torch

        out = dequantized_mxfp4(tensors)
        for key, value in dict(out).items():
            kind = key.rsplit(".", 1)[-1]
            if not isinstance(value, torch.Tensor):  # a names-only pass (convert --check maps names alone)
                continue
            if ".mlp.experts." not in key or kind not in EXPERT_TENSORS or value.dim() < 2:
                continue
            if kind == "gate_up_proj":  # (E, H, 2F) interleaved -> (E * 2F, H) gate rows, then up rows
                rows = value.transpose(1, 2)
                out[key] = torch.cat((rows[:, 0::2], rows[:, 1::2]), dim=1).reshape(-1, value.shape[1])
            elif kind == "gate_up_proj_bias":  # (E, 2F) interleaved -> (E * 2F,)
                out[key] = torch.cat((value[:, 0::2], value[:, 1::2]), dim=1).reshape(-1)
            elif kind == "down_proj":  # (E, F, H) -> (E * H, F)
                out[key] = value.transpose(1, 2).reshape(-1, value.shape[1])
            else:  # down_proj_bias (E, H) -> (E * H,)
                out[key] = value.reshape(-1)
        return out

    def checkpoint_layout(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Inverse of `normalise_keys`: the experts' tensors as transformers stacks them."""
        import torch

        out = dict(tensors)
        experts = {key.rsplit(".", 2)[0]: tensors[key].shape[0] for key in tensors if key.endswith(".mlp.router.bias")}
        for mlp, count in experts.items():
            gate_up, gate_up_bias = tensors[f"{mlp}.experts.gate_up_proj"], tensors[f"{mlp}.experts.gate_up_proj_bias"]
            down, down_bias = tensors[f"{mlp}.experts.down_proj"], tensors[f"{mlp}.experts.down_proj_bias"]
            rows = gate_up.view(count, -1, gate_up.shape[1])  # (E, 2F, H)
            gate, up = rows.chunk(2, dim=1)
            out[f"{mlp}.experts.gate_up_proj"] = torch.stack((gate, up), dim=2).flatten(1, 2).transpose(1, 2).contiguous()
            gate, up = gate_up_bias.view(count, -1).chunk(2, dim=1)
            out[f"{mlp}.experts.gate_up_proj_bias"] = torch.stack((gate, up), dim=2).flatten(1, 2).contiguous()
            out[f"{mlp}.experts.down_proj"] = down.view(count, -1, down.shape[1]).transpose(1, 2).contiguous()
            out[f"{mlp}.experts.down_proj_bias"] = down_bias.view(count, -1).contiguous()
        return out


def dequantized_mxfp4(tensors: dict[str, Any]) -> dict[str, Any]:
    """`tensors` with every MXFP4 pair `<name>_blocks` (E, R, G, 16) uint8 + `<name>_scales` (E, R, G) uint8
    replaced by `<name>` in bf16, laid out as transformers' experts are: (E, G * 32, R) (value 2i of a block is
    its byte i's low nibble, 2i + 1 the high one, times 2^(scale - 127))."""
    import torch

    out = dict(tensors)
    for key in [key for key in tensors if key.endswith("_blocks") and key[:-7] + "_scales" in tensors]:
        name = key[:-7]
        blocks, scales = out.pop(key), out.pop(name + "_scales")
        table = torch.tensor(FP4_E2M1, dtype=torch.float32)
        values = torch.stack((table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]), dim=-1).flatten(-2)
        values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)  # (E, R, G, 32)
        out[name] = values.flatten(-2).transpose(1, 2).to(torch.bfloat16).contiguous()
    return out
