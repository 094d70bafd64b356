"""What a family's Hugging Face adapter is made of: a reader of config.json fields (HF defaults for
missing keys, every problem collected), weight rules (fastlm tensor <-> HF tensors), and the `HFAdapter`
base a family subclasses. Helpers for what several families share (RoPE parameters, per-layer attention
types) live here too. Pure Python: no torch, no transformers."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from fastlm.config.errors import ConfigIssue

if TYPE_CHECKING:
    from fastlm.models.base import DecoderConfig

SLIDING, FULL = "sliding_attention", "full_attention"  # HF's layer_types values
MAX_DERIVED_LAYERS = 1 << 20  # per-layer kinds are only derived up to this many layers (a hostile file may claim 10^15)


class Reader:
    """Reads fields of one config.json with the architecture's defaults and collects every problem."""

    def __init__(self, hf: Mapping[str, Any], defaults: Mapping[str, Any], source: str) -> None:
        self.hf, self.defaults, self.source = hf, defaults, source
        self.issues: list[ConfigIssue] = []

    def get(self, key: str) -> Any:
        if key in self.hf:
            return self.hf[key]
        if key in self.defaults:
            return self.defaults[key]
        self.issues.append(ConfigIssue(key, "required field is missing", source=self.source))
        return None

    def fields(self, names: Mapping[str, str]) -> dict[str, Any]:
        """Our fields from the HF keys `names` maps them to."""
        return {ours: self.get(theirs) for ours, theirs in names.items()}

    def expect(self, key: str, allowed: tuple[Any, ...], why: str) -> Any:
        value = self.get(key)
        if (key in self.hf or key in self.defaults) and value not in allowed:
            self.fail(key, f"unsupported value ({why})", value, f"fastlm supports {list(allowed)}")
        return value

    def fail(self, key: str, message: str, value: Any, hint: str | None = None) -> None:
        self.issues.append(ConfigIssue(key, message, value, self.source, hint))


@dataclass(frozen=True)
class WeightRule:
    """One fastlm tensor = the HF tensors `theirs` concatenated along dim 0 (rows `sizes` each);
    `transpose`: HF stores each piece as (in, out) (GPT-2's Conv1D); `rows`: our row i is row rows[i] of
    the concatenation (a permutation: GLM-4's interleaved rotary dims in our half-split order)."""

    ours: str
    theirs: tuple[str, ...]
    sizes: tuple[int, ...] | None = None
    transpose: bool = False
    rows: tuple[int, ...] | None = None


class HFAdapter:
    """A family's mapping to and from Hugging Face checkpoints. Subclasses set the class attributes and
    implement `fields` (config.json -> our fields), `to_hf` (our config -> config.json keys) and
    `weight_rules`."""

    model_types: ClassVar[tuple[str, ...]]  # config.json model_type values this family imports
    defaults: ClassVar[dict[str, dict[str, Any]]]  # per model_type: HF config class defaults for omitted keys
    embedding_key: ClassVar[str]  # the HF name of the token embedding (the tied output weight)
    ignored_suffixes: ClassVar[tuple[str, ...]] = (".rotary_emb.inv_freq",)  # buffers old checkpoints saved

    def fields(self, reader: Reader, model_type: str) -> dict[str, Any]:
        """Our model section (with `type`) from a config.json; problems go to `reader.fail`."""
        raise NotImplementedError

    def to_hf(self, config: DecoderConfig) -> dict[str, Any]:
        """model_type, architectures and the architecture keys of the HF config that computes the same logits."""
        raise NotImplementedError

    def export_issues(self, config: DecoderConfig) -> list[ConfigIssue]:
        """What the HF architecture cannot express (each a `model.<field>` issue); none by default."""
        return []

    def weight_rules(self, config: DecoderConfig) -> list[WeightRule]:
        """Every tensor of `DecoderLM(config).state_dict()` and where it lives in the HF layout."""
        raise NotImplementedError

    def normalise_keys(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Checkpoint tensor names in the layout `weight_rules` expects (older naming variants)."""
        return tensors

    def checkpoint_layout(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """The export's tensors in the checkpoint's layout, where `normalise_keys` reshapes them (GPT-OSS's
        experts); the identity by default."""
        return tensors

    @staticmethod
    def head_rule(config: DecoderConfig) -> list[WeightRule]:
        return [] if config.tie_embeddings else [WeightRule("lm_head_weight", ("lm_head.weight",))]


# --- shared by several families ---------------------------------------------------------------------
def rope_parameters(reader: Reader, layer_type: str | None = None) -> tuple[dict[str, Any], str]:
    """The RoPE parameters of a config.json as one flat dict with `rope_type` and `rope_theta`, and the key
    they came from: the older `rope_scaling` when set (transformers gives it priority), else transformers 5's
    `rope_parameters` (flat, or nested per layer type: then `layer_type`'s), with `rope_theta` beside them."""
    hf = reader.hf
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    parameters = hf.get(key) or {}
    if not isinstance(parameters, Mapping):
        raise TypeError(f"{key} must be a mapping, not {type(parameters).__name__}")
    nested = bool(parameters) and all(isinstance(v, Mapping) or v is None for v in parameters.values())
    if nested:
        if layer_type is None:
            distinct = {json.dumps(v, sort_keys=True) for v in parameters.values()}
            if len(distinct) > 1:
                reader.fail(key, "per-layer-type RoPE parameters differ", parameters)
            parameters = next(iter(parameters.values())) or {}
        else:
            key, parameters = f"{key}.{layer_type}", parameters.get(layer_type) or {}
    merged = dict(parameters)
    merged.setdefault("rope_theta", hf.get("rope_theta", reader.defaults.get("rope_theta", 10000.0)))
    merged["rope_type"] = merged.get("rope_type", merged.get("type", "default"))
    return merged, key


def rope_fields(reader: Reader, parameters: Mapping[str, Any], key: str,
                max_positions: Any) -> tuple[float | None, dict[str, Any] | None]:
    """(rope_theta, our `rope_scaling` section or None) of flat HF RoPE parameters; unsupported kinds
    (dynamic, partial rotary, ...) are errors naming `key`."""
    rope_type = parameters.get("rope_type", "default")
    partial = parameters.get("partial_rotary_factor", reader.hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        reader.fail("partial_rotary_factor", "partial rotary embeddings are not supported", partial)
    theta = parameters.get("rope_theta")
    if rope_type == "default":
        return theta, None
    original = parameters.get("original_max_position_embeddings",
                              reader.hf.get("original_max_position_embeddings", max_positions))
    common = {"factor": parameters.get("factor")}
    if rope_type == "linear":
        return theta, {"type": "linear", **common}
    if rope_type == "llama3":
        return theta, {"type": "llama3", **common, "original_max_seq_len": original,
                       "low_freq_factor": parameters.get("low_freq_factor"),
                       "high_freq_factor": parameters.get("high_freq_factor")}
    if rope_type == "yarn":
        if common["factor"] is None and isinstance(max_positions, int) and isinstance(original, int):
            common["factor"] = max_positions / original
        optional = {name: parameters[name] for name in ("attention_factor", "mscale", "mscale_all_dim", "truncate")
                    if parameters.get(name) is not None}
        optional.update({name: parameters[name] for name in ("beta_fast", "beta_slow") if parameters.get(name)})
        return theta, {"type": "yarn", **common, "original_max_seq_len": original, **optional}
    if rope_type == "longrope":
        if common["factor"] is None and isinstance(max_positions, int) and isinstance(original, int):
            common["factor"] = max_positions / original  # transformers' default (Phi-3 files leave factor out)
        optional = {"attention_factor": parameters["attention_factor"]} \
            if parameters.get("attention_factor") is not None else {}
        return theta, {"type": "longrope", **common, "original_max_seq_len": original, **optional,
                       "short_factor": parameters.get("short_factor"), "long_factor": parameters.get("long_factor")}
    reader.fail(f"{key}.rope_type", "this RoPE scaling is not supported", rope_type,
                "fastlm supports default, linear, llama3, yarn and longrope")
    return theta, None


# the keys transformers' RoPE validation accepts per rope_type (beside rope_type and rope_theta): the export writes
# only these, so transformers loads it without "unrecognized keys" warnings
_HF_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
             "mscale_all_dim", "truncate"),
    "longrope": ("factor", "original_max_position_embeddings", "attention_factor", "short_factor", "long_factor"),
}


def rope_to_hf(theta: float, scaling: Any) -> dict[str, Any]:
    """Flat HF RoPE parameters (transformers 5 naming) of our theta and `RopeScaling` (or None)."""
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    values = scaling.model_dump(exclude_none=True)
    if "original_max_seq_len" in values:
        values["original_max_position_embeddings"] = values.pop("original_max_seq_len")
    values = {key: list(value) if isinstance(value, tuple) else value for key, value in values.items()}
    return {"rope_type": scaling.type, **{key: values[key] for key in _HF_ROPE_KEYS[scaling.type] if key in values},
            "rope_theta": theta}


def layer_types(reader: Reader, window: int | None, num_layers: Any,
                max_window_layers: int | None = None) -> list[str] | None:
    """HF's per-layer attention kinds: `layer_types` when given, else derived the way the HF config class
    does (Qwen: layers from `max_window_layers` on slide when a window is used); None: no per-layer list."""
    given = reader.hf.get("layer_types")
    if given is not None:
        if not isinstance(given, list) or not set(given) <= {SLIDING, FULL}:
            reader.fail("layer_types", f"must be a list of {FULL!r} / {SLIDING!r}", given)
            return None
        if isinstance(num_layers, int) and len(given) != num_layers:
            reader.fail("layer_types", f"must have one entry per layer ({num_layers})", given)
            return None
        return given
    if window is None or max_window_layers is None or not plausible_layers(reader, num_layers):
        return None
    return [SLIDING if i >= max_window_layers else FULL for i in range(num_layers)]


def plausible_layers(reader: Reader, num_layers: Any) -> bool:
    """Whether per-layer lists may be built for `num_layers` (an int, at most MAX_DERIVED_LAYERS)."""
    if not isinstance(num_layers, int):
        return False
    if num_layers > MAX_DERIVED_LAYERS:
        reader.fail("num_hidden_layers", f"more than {MAX_DERIVED_LAYERS:,} layers", num_layers,
                    "check num_hidden_layers in config.json")
        return False
    return True
