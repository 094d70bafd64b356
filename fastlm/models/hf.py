"""Hugging Face checkpoint interop: `config.json` + safetensors <-> `ModelConfig` + `DecoderLM` weights.

Supported: GPT-2 (`gpt2`) and the Llama family (`llama`, `qwen2` = llama + qkv biases, `mistral` =
llama + sliding window). Options our decoder cannot reproduce exactly (RoPE scaling, other
activations, Llama attention/MLP biases, per-layer attention patterns, ...) are errors that name the
config.json field; nothing is silently dropped. Only safetensors are read and written (no pickle).
transformers is not needed here: config.json is read as plain JSON, with the defaults of the HF
config classes for keys a file leaves out.

Layout notes: our RoPE uses the same half-split convention as HF's `rotate_half`, so q/k weights are
copied as they are; our fused qkv (q, k, v rows) and gate_up (gate, up rows) are HF's separate
projections concatenated; GPT-2's Conv1D stores (in, out), the transpose of our nn.Linear weights.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from pydantic import TypeAdapter, ValidationError
from safetensors.torch import load_file, save_file

from fastlm.config.errors import ConfigError, ConfigIssue
from fastlm.data.tokenizer import Tokenizer, TokenizerError, build_tokenizer
from fastlm.models.config import GPT2Config, LlamaConfig, ModelConfig
from fastlm.models.build import describe_count, num_parameters
from fastlm.models.decoder import DecoderLM, build_model

DecoderConfigType = GPT2Config | LlamaConfig
StateDict = dict[str, torch.Tensor]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FASTLM_CONFIG_FILE = "model.yaml"
SUPPORTED_TYPES = ("gpt2", "llama", "qwen2", "mistral")

# Defaults of the installed HF config classes (transformers 5.x source) for keys a config.json omits.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": {"n_inner": None, "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1,
             "attn_pdrop": 0.1, "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "n_positions": 1024,
             "tie_word_embeddings": True, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
             "add_cross_attention": False},
    "llama": {"num_key_value_heads": None, "hidden_act": "silu", "max_position_embeddings": 2048,
              "initializer_range": 0.02, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "head_dim": None},
    "qwen2": {"num_key_value_heads": 32, "hidden_act": "silu", "max_position_embeddings": 32768,
              "initializer_range": 0.02, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 28, "layer_types": None},
    "mistral": {"num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 4096 * 32,
                "initializer_range": 0.02, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                "attention_dropout": 0.0, "head_dim": None, "sliding_window": 4096, "layer_types": None},
}
_GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both are the tanh GELU our GeluMLP uses
_SILU_ACTIVATIONS = ("silu", "swish")
_ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "mistral": "MistralForCausalLM"}


# --- config.json -> ModelConfig --------------------------------------------------------------------
class _Reader:
    """Reads fields of one config.json with the architecture's defaults and collects every problem."""

    def __init__(self, hf: Mapping[str, Any], model_type: str, source: str) -> None:
        self.hf, self.defaults, self.source = hf, _HF_DEFAULTS[model_type], source
        self.issues: list[ConfigIssue] = []

    def get(self, key: str) -> Any:
        if key in self.hf:
            return self.hf[key]
        if key in self.defaults:
            return self.defaults[key]
        self.issues.append(ConfigIssue(key, "required field is missing", source=self.source))
        return None

    def expect(self, key: str, allowed: tuple[Any, ...], why: str) -> Any:
        value = self.get(key)
        if key in self.hf or key in self.defaults:
            if value not in allowed:
                self.fail(key, f"unsupported value ({why})", value, f"fastlm supports {list(allowed)}")
        return value

    def fail(self, key: str, message: str, value: Any, hint: str | None = None) -> None:
        self.issues.append(ConfigIssue(key, message, value, self.source, hint))


def config_from_hf(hf: Mapping[str, Any], source: str = CONFIG_FILE) -> DecoderConfigType:
    """Map a HF config.json dict to our model config; `ConfigError` names every unsupported field."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        raise ConfigError(ConfigIssue("model_type", "unsupported architecture", model_type, source,
                                      f"fastlm converts {', '.join(SUPPORTED_TYPES)}"))
    reader = _Reader(hf, model_type, source)
    try:
        fields = _gpt2_fields(reader) if model_type == "gpt2" else _llama_fields(reader, model_type)
    except (TypeError, AttributeError, ValueError, OverflowError, ZeroDivisionError) as error:
        raise ConfigError(ConfigIssue("", f"a field has the wrong type or value ({error})", source=source,
                                      hint="compare config.json with one written by save_pretrained")) from None
    if reader.issues:
        raise ConfigError(reader.issues)
    try:
        return TypeAdapter(ModelConfig).validate_python(fields)
    except ValidationError as error:
        raise ConfigError([ConfigIssue(".".join(map(str, item["loc"][1:])), item["msg"], item.get("input"), source,
                                       "the HF config maps to an invalid fastlm model")
                           for item in error.errors()]) from None


def _common_fields(reader: _Reader, names: dict[str, str]) -> dict[str, Any]:
    """Fields every decoder has; `names` maps our field to the HF key of this architecture."""
    return {ours: reader.get(theirs) for ours, theirs in names.items()}


def _gpt2_fields(reader: _Reader) -> dict[str, Any]:
    fields = _common_fields(reader, {
        "vocab_size": "vocab_size", "hidden_size": "n_embd", "num_layers": "n_layer", "num_heads": "n_head",
        "max_seq_len": "n_positions", "intermediate_size": "n_inner", "norm_eps": "layer_norm_epsilon",
        "init_std": "initializer_range", "tie_embeddings": "tie_word_embeddings",
    })
    reader.expect("activation_function", _GPT2_ACTIVATIONS, "GPT-2 blocks here use the tanh GELU")
    reader.expect("scale_attn_weights", (True,), "attention is always scaled by 1/sqrt(head_dim)")
    reader.expect("scale_attn_by_inverse_layer_idx", (False,), "no per-layer attention scaling")
    reader.expect("add_cross_attention", (False,), "decoder-only, no cross-attention")
    # reorder_and_upcast_attn is accepted: it only changes mixed-precision rounding, not the math
    rates = {key: reader.get(key) for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    if len(set(rates.values())) > 1:
        reader.fail("attn_pdrop", "fastlm has one model.dropout for embeddings, residuals and attention",
                    rates, "set resid_pdrop, embd_pdrop and attn_pdrop to the same value")
    return {"type": "gpt2", **fields, "dropout": rates["resid_pdrop"]}


def _llama_fields(reader: _Reader, model_type: str) -> dict[str, Any]:
    fields = _common_fields(reader, {
        "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
        "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
        "intermediate_size": "intermediate_size", "max_seq_len": "max_position_embeddings",
        "norm_eps": "rms_norm_eps", "init_std": "initializer_range", "tie_embeddings": "tie_word_embeddings",
    })
    reader.expect("hidden_act", _SILU_ACTIVATIONS, "the MLP is SwiGLU")
    reader.expect("attention_dropout", (0, 0.0), "model.dropout would also drop residual branches")
    if model_type == "llama":
        reader.expect("attention_bias", (False,), "Llama blocks here have no q/k/v/o biases; Qwen2 has q/k/v only")
        reader.expect("mlp_bias", (False,), "the SwiGLU MLP has no biases")
    head_dim = reader.hf.get("head_dim")
    heads, hidden = fields["num_heads"], fields["hidden_size"]
    if head_dim is not None and isinstance(heads, int) and isinstance(hidden, int) and head_dim * heads != hidden:
        reader.fail("head_dim", f"must equal hidden_size / num_attention_heads = {hidden // heads}", head_dim)
    fields["rope_theta"] = _rope_theta(reader)
    fields["sliding_window"] = _sliding_window(reader, model_type, fields["num_layers"])
    return {"type": "llama", **fields, "qkv_bias": model_type == "qwen2", "dropout": 0.0}


def _rope_theta(reader: _Reader) -> float | None:
    """Plain RoPE only: `rope_parameters` (transformers 5) or the older `rope_theta` + `rope_scaling`."""
    hf = reader.hf
    if hf.get("rope_scaling") is not None:
        reader.fail("rope_scaling", "RoPE scaling is not supported", hf["rope_scaling"], "use plain RoPE (null)")
    parameters = hf.get("rope_parameters") or {}
    if parameters and all(isinstance(v, Mapping) for v in parameters.values()):  # nested per layer type
        distinct = {json.dumps(v, sort_keys=True) for v in parameters.values()}
        if len(distinct) > 1:
            reader.fail("rope_parameters", "per-layer-type RoPE parameters differ", parameters)
            return None
        parameters = next(iter(parameters.values()))
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type != "default":
        reader.fail("rope_parameters.rope_type", "only plain RoPE is supported", rope_type, "use 'default'")
    partial = parameters.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        reader.fail("partial_rotary_factor", "partial rotary embeddings are not supported", partial)
    return float(parameters.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _sliding_window(reader: _Reader, model_type: str, num_layers: Any) -> int | None:
    """One window for every layer, or none; HF's per-layer mixes (Qwen2 max_window_layers) are errors."""
    if model_type == "llama":
        return None
    window = reader.get("sliding_window")
    if model_type == "qwen2" and not reader.get("use_sliding_window"):
        window = None
    layer_types = reader.get("layer_types")
    if layer_types is None and model_type == "qwen2" and window is not None and isinstance(num_layers, int):
        first = reader.get("max_window_layers")
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if layer_types is None:
        return window
    kinds = set(layer_types)
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"} and window is not None:
        return window
    key = "max_window_layers" if model_type == "qwen2" and reader.hf.get("layer_types") is None else "layer_types"
    reader.fail(key, "fastlm applies one attention pattern (full or one sliding window) to every layer",
                reader.hf.get(key, layer_types), "use the same attention type for all layers")
    return None


# --- ModelConfig -> config.json --------------------------------------------------------------------
def hf_model_type(config: DecoderConfigType) -> str:
    """gpt2; for Llama configs: qwen2 with qkv biases, mistral with a sliding window, else llama."""
    if isinstance(config, GPT2Config):
        return "gpt2"
    if config.qkv_bias:
        return "qwen2"
    return "mistral" if config.sliding_window else "llama"


def config_to_hf(config: DecoderConfigType, tokenizer: Tokenizer, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The config.json of the HF model that computes the same logits, with the tokenizer's special ids;
    `ConfigError` if no HF model does."""
    issues = []
    head = config.head
    if tokenizer.vocab_size > config.vocab_size:
        issues.append(ConfigIssue("model.vocab_size", f"smaller than the {tokenizer.name} tokenizer's "
                                  f"{tokenizer.vocab_size} ids", config.vocab_size, hint="export with the run's tokenizer"))
    if head.logit_scale != 1.0:
        issues.append(ConfigIssue("model.head.logit_scale", "HF causal LMs have no logit scale", head.logit_scale,
                                  hint="export a model trained with logit_scale 1.0"))
    if head.softcap is not None:
        issues.append(ConfigIssue("model.head.softcap", "these HF architectures have no logit softcap", head.softcap))
    if isinstance(config, LlamaConfig) and config.dropout:
        issues.append(ConfigIssue("model.dropout", "HF Llama-family models have attention dropout only",
                                  config.dropout, hint="set model.dropout: 0.0"))
    if issues:
        raise ConfigError(issues)
    model_type = hf_model_type(config)
    common = {"architectures": [_ARCHITECTURES[model_type]], "model_type": model_type,
              "dtype": str(dtype).removeprefix("torch."),
              "vocab_size": config.vocab_size, "initializer_range": config.init_std,
              "tie_word_embeddings": config.tie_embeddings,
              **{key: token for key, token in (("bos_token_id", tokenizer.bos_id), ("eos_token_id", tokenizer.eos_id),
                                               ("pad_token_id", tokenizer.pad_id)) if token is not None}}
    if isinstance(config, GPT2Config):
        return {**common, "n_embd": config.hidden_size, "n_layer": config.num_layers, "n_head": config.num_heads,
                "n_positions": config.max_seq_len, "n_inner": config.ffn_size, "activation_function": "gelu_new",
                "layer_norm_epsilon": config.norm_eps, "resid_pdrop": config.dropout, "embd_pdrop": config.dropout,
                "attn_pdrop": config.dropout, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False, "add_cross_attention": False}
    hf = {**common, "hidden_size": config.hidden_size, "intermediate_size": config.ffn_size,
          "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
          "num_key_value_heads": config.kv_heads, "head_dim": config.head_dim, "hidden_act": "silu",
          "max_position_embeddings": config.max_seq_len, "rms_norm_eps": config.norm_eps,
          "attention_dropout": 0.0, "rope_theta": config.rope_theta,  # read by transformers 4.x
          "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta}}
    if model_type == "llama":
        return {**hf, "attention_bias": False, "mlp_bias": False}
    if model_type == "mistral":
        return {**hf, "sliding_window": config.sliding_window}
    window = config.sliding_window
    layer = "sliding_attention" if window else "full_attention"
    return {**hf, "use_sliding_window": window is not None, "sliding_window": window,
            "max_window_layers": 0 if window else config.num_layers, "layer_types": [layer] * config.num_layers}


def model_yaml(config: DecoderConfigType, init_path: str | None = None) -> str:
    """The `model:` section (head left to the run config) plus `run.init_path`, ready to paste or `base:`."""
    document: dict[str, Any] = {"model": {"type": config.type, **config.model_dump(mode="json", exclude={"head", "type", "lora"})}}
    if init_path is not None:
        document["run"] = {"init_path": init_path}
    return yaml.safe_dump(document, sort_keys=False)


# --- weight names ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightRule:
    """One fastlm tensor = the HF tensors `theirs` concatenated along dim 0 (rows `sizes` each);
    `transpose`: HF stores each piece as (in, out) (GPT-2's Conv1D)."""

    ours: str
    theirs: tuple[str, ...]
    sizes: tuple[int, ...] | None = None
    transpose: bool = False


def weight_rules(config: DecoderConfigType) -> list[WeightRule]:
    """Every tensor of `DecoderLM(config).state_dict()` and where it lives in the HF layout."""
    return _gpt2_rules(config) if isinstance(config, GPT2Config) else _llama_rules(config)


def _gpt2_rules(config: GPT2Config) -> list[WeightRule]:
    rules = [WeightRule("embeddings.tokens.weight", ("transformer.wte.weight",)),
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
    return rules + _head_rule(config)


def _llama_rules(config: LlamaConfig) -> list[WeightRule]:
    rules = [WeightRule("embeddings.tokens.weight", ("model.embed_tokens.weight",))]
    q_size, kv_size, ffn = config.hidden_size, config.kv_heads * config.head_dim, config.ffn_size
    for layer in range(config.num_layers):
        base, hf = f"blocks.{layer}", f"model.layers.{layer}"
        qkv = tuple(f"{hf}.self_attn.{name}_proj" for name in "qkv")
        rules.append(WeightRule(f"{base}.attn_norm.weight", (f"{hf}.input_layernorm.weight",)))
        rules.append(WeightRule(f"{base}.attn.qkv_proj.weight", tuple(f"{p}.weight" for p in qkv),
                                (q_size, kv_size, kv_size)))
        if config.qkv_bias:
            rules.append(WeightRule(f"{base}.attn.qkv_proj.bias", tuple(f"{p}.bias" for p in qkv),
                                    (q_size, kv_size, kv_size)))
        rules += [WeightRule(f"{base}.attn.out_proj.weight", (f"{hf}.self_attn.o_proj.weight",)),
                  WeightRule(f"{base}.mlp_norm.weight", (f"{hf}.post_attention_layernorm.weight",)),
                  WeightRule(f"{base}.mlp.gate_up_proj.weight",
                             (f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight"), (ffn, ffn)),
                  WeightRule(f"{base}.mlp.down_proj.weight", (f"{hf}.mlp.down_proj.weight",))]
    return rules + [WeightRule("final_norm.weight", ("model.norm.weight",))] + _head_rule(config)


def _head_rule(config: DecoderConfigType) -> list[WeightRule]:
    return [] if config.tie_embeddings else [WeightRule("lm_head_weight", ("lm_head.weight",))]


def _tied_embedding_key(config: DecoderConfigType) -> str:
    return "transformer.wte.weight" if isinstance(config, GPT2Config) else "model.embed_tokens.weight"


def _ignored(key: str) -> bool:
    """Buffers some older HF checkpoints saved: GPT-2's causal-mask tensors, Llama's RoPE inv_freq."""
    return key.endswith((".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq"))


def _normalise_keys(tensors: StateDict, config: DecoderConfigType) -> StateDict:
    """Original GPT-2 checkpoints name the base model's tensors without the `transformer.` prefix."""
    if isinstance(config, GPT2Config) and not any(key.startswith("transformer.") for key in tensors):
        return {key if key == "lm_head.weight" else f"transformer.{key}": value for key, value in tensors.items()}
    return tensors


def to_fastlm_state(tensors: StateDict, config: DecoderConfigType, source: str = "checkpoint") -> StateDict:
    """HF-named tensors -> our state dict; missing, unexpected or mis-shaped tensors are named in the error."""
    tensors = _normalise_keys(tensors, config)
    rules = weight_rules(config)
    used = {name for rule in rules for name in rule.theirs}
    issues = [ConfigIssue(name, "tensor is missing from the checkpoint", source=source)
              for rule in rules for name in rule.theirs if name not in tensors]
    if config.tie_embeddings and "lm_head.weight" in tensors:
        used.add("lm_head.weight")
        embedding = tensors.get(_tied_embedding_key(config))
        if embedding is not None and not torch.equal(tensors["lm_head.weight"], embedding):
            issues.append(ConfigIssue("lm_head.weight", "differs from the token embedding but the config ties them",
                                      source=source, hint="set tie_word_embeddings: false in config.json"))
    issues += [ConfigIssue(name, "unexpected tensor (no place for it in the fastlm model)", source=source)
               for name in sorted(set(tensors) - used) if not _ignored(name)]
    if issues:
        raise ConfigError(issues)
    state = {}
    for rule in rules:
        pieces = [tensors[name].t() if rule.transpose else tensors[name] for name in rule.theirs]
        if rule.sizes is not None:
            for name, piece, rows in zip(rule.theirs, pieces, rule.sizes):
                if piece.dim() == 0 or piece.shape[0] != rows or piece.shape[1:] != pieces[0].shape[1:]:
                    issues.append(ConfigIssue(name, f"expected {rows} rows of {tuple(pieces[0].shape[1:])}",
                                              tuple(piece.shape), source))
        if not issues:
            state[rule.ours] = torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]
    if issues:
        raise ConfigError(issues)
    return state


def to_hf_state(state: Mapping[str, torch.Tensor], config: DecoderConfigType) -> StateDict:
    """Our state dict -> HF-named, contiguous CPU tensors (tied output weight stored once, as HF does)."""
    tensors: StateDict = {}
    for rule in weight_rules(config):
        value = state[rule.ours].detach().to("cpu")
        pieces = value.split(list(rule.sizes), dim=0) if rule.sizes is not None else (value,)
        for name, piece in zip(rule.theirs, pieces):
            tensors[name] = (piece.t() if rule.transpose else piece).contiguous().clone()
    return tensors


# --- files ----------------------------------------------------------------------------------------
MAX_JSON_BYTES = 64 << 20  # config.json is KiBs; a 10k-tensor index a few MiB


def _read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object from a file that may be hostile (huge, deep, not UTF-8, not an object): `ConfigError`."""
    if not path.is_file():
        raise ConfigError(ConfigIssue("", f"{path} is not a regular file", source=str(path.parent)))
    with path.open("rb") as handle:
        raw = handle.read(MAX_JSON_BYTES + 1)
    if len(raw) > MAX_JSON_BYTES:
        raise ConfigError(ConfigIssue("", f"{path} is larger than {MAX_JSON_BYTES >> 20} MiB", source=str(path)))
    try:
        loaded = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as error:
        reason = "nested too deeply" if isinstance(error, RecursionError) else str(error)
        raise ConfigError(ConfigIssue("", f"{path} is not valid JSON: {reason}", source=str(path))) from None
    if not isinstance(loaded, dict):
        raise ConfigError(ConfigIssue("", f"{path} must hold a JSON object", type(loaded).__name__, str(path)))
    return loaded


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / CONFIG_FILE
    if not path.exists():
        raise ConfigError(ConfigIssue("", f"not a Hugging Face checkpoint directory: {path} is missing",
                                      source=str(directory), hint="point at a folder with config.json + *.safetensors"))
    return _read_json_object(path)


def _inside(directory: Path, name: Any, source: Path) -> Path:
    """`directory / name`, refused unless it stays inside `directory` (after following symlinks)."""
    if not isinstance(name, str) or not name:
        raise ConfigError(ConfigIssue("weight_map", "file names must be non-empty strings", name, str(source)))
    root = directory.resolve()
    path = (directory / name).resolve()
    if not path.is_relative_to(root):
        raise ConfigError(ConfigIssue("weight_map", f"{name} points outside {root}", name, str(source),
                                      "a checkpoint's weight files must lie in its folder"))
    return path


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index names, else every *.safetensors, all inside it."""
    index = directory / INDEX_FILE
    if index.exists():
        weight_map = _read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConfigError(ConfigIssue("weight_map", "must map tensor names to file names",
                                          type(weight_map).__name__, str(index)))
        files = sorted({_inside(directory, name, index) for name in weight_map.values()})
        for file in files:
            if not file.is_file():
                raise ConfigError(ConfigIssue("", f"{file} is listed in {INDEX_FILE} but missing", source=str(index)))
        return files
    return sorted(_inside(directory, path.name, directory) for path in directory.glob("*.safetensors"))


def read_hf_tensors(directory: str | Path) -> StateDict:
    """All tensors of a (possibly sharded) safetensors checkpoint, on CPU, in the stored dtype."""
    directory = Path(directory)
    files = weight_files(directory)
    if not files:
        pickled = [p.name for p in directory.glob("*.bin")]
        hint = (f"found {pickled}: pickle checkpoints are not loaded; re-save with save_pretrained(safe_serialization=True)"
                if pickled else "save the model with save_pretrained")
        raise ConfigError(ConfigIssue("", f"no *.safetensors weights in {directory}", source=str(directory), hint=hint))
    tensors: StateDict = {}
    for file in files:
        if not file.is_file():
            raise ConfigError(ConfigIssue("", f"{file} is not a regular file", source=str(directory)))
        try:
            tensors.update(load_file(str(file), device="cpu"))
        except Exception as error:  # noqa: BLE001 - safetensors raises its own error type for any bad header
            raise ConfigError(ConfigIssue("", f"{file} is not a readable safetensors file: {str(error)[:200]}",
                                          source=str(directory))) from None
    return tensors


def available_memory() -> int:
    """Bytes this process may still allocate: MemAvailable, lowered by a cgroup (container) limit."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        available = int(Path("/proc/meminfo").read_text().split("MemAvailable:")[1].split()[0]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    try:
        limit, used = (Path("/sys/fs/cgroup", name).read_text().strip() for name in ("memory.max", "memory.current"))
        if limit != "max":
            available = min(available, int(limit) - int(used))
    except (OSError, ValueError):
        pass
    return available


def check_fits_memory(config: DecoderConfigType, source: str, bytes_per_value: int = 4) -> None:
    """Refuse, with the numbers, a model whose weights (fp32 on CPU) cannot fit the memory left, before
    anything is allocated: a hostile config.json would otherwise allocate until the machine gives out."""
    count = num_parameters(config)
    needed = count * bytes_per_value
    available = available_memory()
    if needed > available:
        raise ConfigError(ConfigIssue("", f"the model has {describe_count(count)} parameters: "
                                      f"{describe_count(needed // 2**30)} GiB as fp32, "
                                      f"but only {available / 2**30:,.1f} GiB of memory is available", source=source,
                                      hint="check hidden_size / num_hidden_layers / vocab_size in config.json"))


def _architecture(config: DecoderConfigType) -> dict[str, Any]:
    """What decides the weights' shapes and the forward's math (not init, dropout or the loss head)."""
    values = {"type": config.type, "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
              "num_layers": config.num_layers, "num_heads": config.num_heads, "intermediate_size": config.ffn_size,
              "norm_eps": config.norm_eps, "tie_embeddings": config.tie_embeddings}
    if isinstance(config, GPT2Config):
        return {**values, "max_seq_len": config.max_seq_len}
    return {**values, "num_kv_heads": config.kv_heads, "rope_theta": config.rope_theta,
            "qkv_bias": config.qkv_bias, "sliding_window": config.sliding_window}


def check_matches(config: DecoderConfigType, expected: DecoderConfigType, source: str) -> None:
    """`config` (the run's model section) must describe the checkpoint's architecture exactly."""
    ours, theirs = _architecture(config), _architecture(expected)
    issues = [ConfigIssue(f"model.{key}", f"does not match the checkpoint, which has {theirs.get(key)!r}",
                          value, source, "run `fastlm convert --from-hf DIR` to print the matching model section")
              for key, value in ours.items() if theirs.get(key) != value]
    if issues:
        raise ConfigError(issues)


def load_hf_weights_into(model: DecoderLM, directory: str | Path) -> None:
    """Overwrite `model`'s weights with a local HF checkpoint (after checking the architectures match);
    values are cast to the model's dtype and device."""
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("load_hf_weights_into needs a materialised model; build it on a real device, not 'meta'")
    source = str(Path(directory) / CONFIG_FILE)
    expected = config_from_hf(read_hf_config(directory), source)
    check_matches(model.config, expected, source)
    state = to_fastlm_state(read_hf_tensors(directory), expected, str(directory))
    current = model.state_dict()
    wrong = [ConfigIssue(name, f"shape {tuple(value.shape)} does not fit the model's {tuple(current[name].shape)}",
                         source=str(directory)) for name, value in state.items() if value.shape != current[name].shape]
    if wrong or set(state) != set(current):
        raise ConfigError(wrong or f"fastlm model tensors {sorted(set(current) ^ set(state))} have no HF mapping")
    model.load_state_dict(state, strict=True)


def import_hf(directory: str | Path, device: torch.device | str | None = None) -> DecoderLM:
    """Build the fastlm model a HF checkpoint describes and load its weights."""
    source = str(Path(directory) / CONFIG_FILE)
    config = config_from_hf(read_hf_config(directory), source)
    check_fits_memory(config, source)
    model = build_model(config, device)
    load_hf_weights_into(model, directory)
    return model


def save_hf(config: DecoderConfigType, state: Mapping[str, torch.Tensor], directory: str | Path,
            tokenizer: Tokenizer) -> Path:
    """Write config.json + model.safetensors + the tokenizer's files: transformers' `from_pretrained` loads
    the model and `AutoTokenizer` its tokenizer from the one folder."""
    hf_config = config_to_hf(config, tokenizer, next(iter(state.values())).dtype)
    tensors = to_hf_state(state, config)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    (directory / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tokenizer.save_pretrained(directory)
    return directory


def export_hf(model: DecoderLM, directory: str | Path, tokenizer: Tokenizer) -> Path:
    return save_hf(model.config, model.state_dict(), directory, tokenizer)


# --- the fastlm side of `fastlm convert` ----------------------------------------------------------
def save_fastlm(model: DecoderLM, directory: str | Path, init_path: str | None = None) -> Path:
    """model.yaml (the model section) + model.safetensors in our names, as in a training checkpoint."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
              str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    (directory / FASTLM_CONFIG_FILE).write_text(model_yaml(model.config, init_path), encoding="utf-8")
    return directory


def load_fastlm(source: str | Path) -> tuple[DecoderConfigType, StateDict, Tokenizer]:
    """Model config, weights and the run's tokenizer from a `save_fastlm` folder, a checkpoint step folder
    (manifest.json), a checkpoints folder (`latest`) or a run folder (checkpoints/): the newest verified
    checkpoint. The tokenizer is the stored run config's (`data.tokenizer`, else `run.init_path`'s, else bytes)."""
    from fastlm.config.yaml_reader import parse_yaml, read_config_file
    from fastlm.data.config import TokenizerConfig
    from fastlm.engine.checkpoint import LATEST_FILE, MANIFEST_FILE, CheckpointError, load_checkpoint, load_latest_checkpoint

    path = Path(source)
    try:  # the stored config is read as hostile as any: bounded YAML, or a verified checkpoint's manifest
        if (path / FASTLM_CONFIG_FILE).is_file():
            stored = parse_yaml(read_config_file(path / FASTLM_CONFIG_FILE, str(path)), str(path / FASTLM_CONFIG_FILE))
        elif (path / MANIFEST_FILE).is_file():
            stored = load_checkpoint(path).config
        else:
            folder = path if (path / LATEST_FILE).exists() else path / "checkpoints"
            loaded = load_latest_checkpoint(folder)
            path, stored = loaded.path, loaded.config
    except CheckpointError as error:
        raise ConfigError(ConfigIssue("", str(error), source=str(source))) from None
    try:
        if not isinstance(stored, dict) or not isinstance(stored.get("data", {}), dict):
            raise ValueError(f"expected a mapping with a 'model' section, got {type(stored).__name__}")
        config = TypeAdapter(ModelConfig).validate_python(stored.get("model"))
        tokenizer_config = TypeAdapter(TokenizerConfig | None).validate_python(stored.get("data", {}).get("tokenizer"))
        init_path = (stored.get("run") or {}).get("init_path")
    except (ValidationError, ValueError, AttributeError) as error:
        raise ConfigError(f"{path}: stored config is invalid: {error}") from None
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise ConfigError(ConfigIssue("", f"{weights} is missing", source=str(path)))
    tokenizer = build_tokenizer(tokenizer_config, init_path)
    try:
        state = load_file(str(weights), device="cpu")
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error type for any bad header
        raise ConfigError(ConfigIssue("", f"{weights} is not a readable safetensors file: {str(error)[:200]}",
                                      source=str(path))) from None
    return config, state, tokenizer


def convert_command(from_hf: str | None, to: str | None, from_fastlm: str | None, to_hf: str | None) -> int:
    """`fastlm convert`: --from-hf DIR [--to DIR] imports (prints the model YAML), --from SRC --to-hf DIR exports."""
    import sys

    try:
        if from_hf is not None:
            if from_fastlm is not None:
                raise ConfigError("--from is for --to-hf; with --from-hf use --to DIR")
            model = import_hf(from_hf, "cpu")
            print(model_yaml(model.config, str(Path(from_hf).resolve())), end="")
            if to is not None:
                print(f"# wrote {save_fastlm(model, to, str(Path(from_hf).resolve()))}", file=sys.stderr)
            return 0
        if from_fastlm is None or to is not None:
            raise ConfigError("--to-hf DIR needs --from SRC (a checkpoint or a `convert --to` folder) and no --to")
        config, state, tokenizer = load_fastlm(from_fastlm)
        if config.lora is not None:
            raise ConfigError(f"--from {from_fastlm} is a LoRA run: add --merge-lora (or use --to-peft DIR)")
        print(f"wrote {save_hf(config, state, to_hf, tokenizer)} ({hf_model_type(config)}, {tokenizer.name} tokenizer)")
        return 0
    except ConfigError as error:
        print(error.render(), file=sys.stderr)
        return 2
    except TokenizerError as error:
        print(f"fastlm convert: {error}", file=sys.stderr)
        return 2
