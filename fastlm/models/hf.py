"""Hugging Face checkpoint interop: `config.json` + safetensors <-> `ModelConfig` + `DecoderLM` weights.

Family-agnostic: which families exist and how each maps its config and weights is the family's HF
adapter (`fastlm/models/<family>/hf.py`, found through `fastlm.models.registry`). Options a family
cannot reproduce exactly are errors that name the config.json field; nothing is silently dropped. Only
safetensors are read and written (no pickle). transformers is not needed here: config.json is read as
plain JSON, with the defaults of the HF config classes for keys a file leaves out.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import yaml
from pydantic import TypeAdapter, ValidationError
from safetensors.torch import load_file, save_file

from fastlm.config.errors import ConfigError, ConfigIssue
from fastlm.data.tokenizer import Tokenizer
from fastlm.models.base import DecoderConfig
from fastlm.models.build import describe_count, num_parameters
from fastlm.models.config import ModelConfig
from fastlm.models.decoder import DecoderLM, build_model
from fastlm.models.hf_adapter import Reader, WeightRule
from fastlm.models.registry import family_for_model_type, family_of, hf_model_types

StateDict = dict[str, torch.Tensor]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FASTLM_CONFIG_FILE = "model.yaml"


# --- config.json -> ModelConfig --------------------------------------------------------------------
def config_from_hf(hf: Mapping[str, Any], source: str = CONFIG_FILE) -> DecoderConfig:
    """Map a HF config.json dict to our model config; `ConfigError` names every unsupported field."""
    model_type = hf.get("model_type")
    family = family_for_model_type(model_type)
    if family is None:
        raise ConfigError(ConfigIssue("model_type", "unsupported architecture", model_type, source,
                                      f"fastlm converts {', '.join(hf_model_types())}"))
    reader = Reader(hf, family.hf.defaults[model_type], source)
    try:
        fields = family.hf.fields(reader, model_type)
    except (TypeError, AttributeError, ValueError, OverflowError, ZeroDivisionError, KeyError) as error:
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


# --- ModelConfig -> config.json --------------------------------------------------------------------
def hf_model_type(config: DecoderConfig) -> str:
    """The model_type the export writes."""
    return family_of(config).hf.to_hf(config)["model_type"]


def config_to_hf(config: DecoderConfig, tokenizer: Tokenizer, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The config.json of the HF model that computes the same logits, with the tokenizer's special ids;
    `ConfigError` if no HF model does."""
    adapter = family_of(config).hf
    issues = []
    head = config.head
    if tokenizer.vocab_size > config.vocab_size:
        issues.append(ConfigIssue("model.vocab_size", f"smaller than the {tokenizer.name} tokenizer's "
                                  f"{tokenizer.vocab_size} ids", config.vocab_size, hint="export with the run's tokenizer"))
    logit_scale, softcap = config.head_transform()  # what the HF architecture applies itself
    if head.logit_scale != logit_scale:
        issues.append(ConfigIssue("model.head.logit_scale", "the HF architecture has no such logit scale",
                                  head.logit_scale, hint=f"export a model trained with logit_scale {logit_scale}"))
    if head.softcap != softcap:
        issues.append(ConfigIssue("model.head.softcap", "the HF architecture has no such logit softcap", head.softcap))
    issues += adapter.export_issues(config)
    if issues:
        raise ConfigError(issues)
    return {**adapter.to_hf(config), "dtype": str(dtype).removeprefix("torch."),
            "vocab_size": config.vocab_size, "initializer_range": config.init_std,
            "tie_word_embeddings": config.tie_embeddings,
            **{key: token for key, token in (("bos_token_id", tokenizer.bos_id), ("eos_token_id", tokenizer.eos_id),
                                             ("pad_token_id", tokenizer.pad_id)) if token is not None}}


def model_yaml(config: DecoderConfig, init_path: str | None = None) -> str:
    """The `model:` section (head left to the run config) plus `run.init_path`, ready to paste or `base:`."""
    document: dict[str, Any] = {"model": {"type": config.type,  # type: ignore[attr-defined]
                                          **config.model_dump(mode="json", exclude={"head", "type", "lora"})}}
    if init_path is not None:
        document["run"] = {"init_path": init_path}
    return yaml.safe_dump(document, sort_keys=False)


# --- weight names ---------------------------------------------------------------------------------
def weight_rules(config: DecoderConfig) -> list[WeightRule]:
    """Every tensor of `DecoderLM(config).state_dict()` and where it lives in the HF layout."""
    return family_of(config).hf.weight_rules(config)


def to_fastlm_state(tensors: StateDict, config: DecoderConfig, source: str = "checkpoint") -> StateDict:
    """HF-named tensors -> our state dict; missing, unexpected or mis-shaped tensors are named in the error."""
    adapter = family_of(config).hf
    tensors = adapter.normalise_keys(tensors)
    rules = adapter.weight_rules(config)
    used = {name for rule in rules for name in rule.theirs}
    issues = [ConfigIssue(name, "tensor is missing from the checkpoint", source=source)
              for rule in rules for name in rule.theirs if name not in tensors]
    if config.tie_embeddings and "lm_head.weight" in tensors:
        used.add("lm_head.weight")
        embedding = tensors.get(adapter.embedding_key)
        if embedding is not None and not torch.equal(tensors["lm_head.weight"], embedding):
            issues.append(ConfigIssue("lm_head.weight", "differs from the token embedding but the config ties them",
                                      source=source, hint="set tie_word_embeddings: false in config.json"))
    issues += [ConfigIssue(name, "unexpected tensor (no place for it in the fastlm model)", source=source)
               for name in sorted(set(tensors) - used) if not name.endswith(adapter.ignored_suffixes)]
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
            if rule.rows is not None:
                state[rule.ours] = state[rule.ours][list(rule.rows)]
    if issues:
        raise ConfigError(issues)
    return state


def to_hf_state(state: Mapping[str, torch.Tensor], config: DecoderConfig) -> StateDict:
    """Our state dict -> HF-named, contiguous CPU tensors (tied output weight stored once, as HF does)."""
    tensors: StateDict = {}
    for rule in weight_rules(config):
        value = state[rule.ours].detach().to("cpu")
        if rule.rows is not None:  # back to the checkpoint's row order
            value = value[torch.argsort(torch.tensor(rule.rows))]
        pieces = value.split(list(rule.sizes), dim=0) if rule.sizes is not None else (value,)
        for name, piece in zip(rule.theirs, pieces):
            tensors[name] = (piece.t() if rule.transpose else piece).contiguous().clone()
    return family_of(config).hf.checkpoint_layout(tensors)


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


def check_fits_memory(config: DecoderConfig, source: str, bytes_per_value: int = 4) -> None:
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


def check_matches(config: DecoderConfig, expected: DecoderConfig, source: str) -> None:
    """`config` (the run's model section) must describe the checkpoint's architecture exactly."""
    ours, theirs = config.architecture(), expected.architecture()
    if ours.get("type") != theirs.get("type"):
        ours, theirs = {"type": ours.get("type")}, {"type": theirs.get("type")}
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


def save_hf(config: DecoderConfig, state: Mapping[str, torch.Tensor], directory: str | Path,
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
