"""Layered config resolution: defaults < YAML (with `base:` inheritance) < CLI overrides.

Every leaf value remembers where it came from (a file, or an override), so a validation error can
say "model.hidden_size: ... from configs/tiny.yaml" instead of only "invalid".
"""

from __future__ import annotations

import difflib
import math
import os
import re
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from fastlm.config.errors import _MISSING, ConfigError, ConfigIssue
from fastlm.config.user_code import user_code_sections
from fastlm.config.yaml_reader import parse_yaml, read_config_file
from fastlm.engine.init_path import HUB_NAME, checkpoint_tokenizer, resolve_init_path
from fastlm.models.build import describe_count, num_parameters
from fastlm.run_config.checks import cross_check
from fastlm.run_config.schema import RunConfig

BASE_KEY = "base"
HUB_NAME_KEYS = ("run.init_path", "rl.teacher.path")  # may name a hub model (Qwen/Qwen3-0.6B) instead of a folder
DEFAULT_SOURCE = "defaults"
MAX_CONFIG_FILES = 64  # a config plus its bases, counted with repeats
MAX_REPORTED_ISSUES = 50  # a file of 20,000 unknown keys needs the first few named, not 20,000 lines


@dataclass
class LayeredDict:
    """A merged mapping plus, for each dotted path set by a layer, the layer that set it."""

    data: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    _below: dict[str, list[str]] | None = field(default=None, init=False, repr=False)

    def set_source(self, path: str, source: str) -> None:
        self.sources[path] = source
        self._below = None

    def drop_sources_below(self, path: str, replaced: dict[str, Any]) -> None:
        """`replaced` (the section that stood at `path`) is gone: forget where its keys came from.
        Walks the replaced section, not every known path, so a merge stays linear."""
        for key, value in replaced.items():
            dotted = f"{path}.{key}"
            self.sources.pop(dotted, None)
            if isinstance(value, dict):
                self.drop_sources_below(dotted, value)
        self._below = None

    def source_of(self, path: str) -> str:
        """The layers that set `path` (every layer below it, for a section), else its nearest parent's;
        defaults when nothing did."""
        if self._below is None:  # every section's layers, built once: one lookup per issue, not a scan
            self._below = {}
            for key, source in self.sources.items():
                parts = key.split(".")
                for end in range(1, len(parts)):
                    self._below.setdefault(".".join(parts[:end]), []).append(source)
        path = re.sub(r"\[\d+\]", "", path)  # an item of a list (rl.rewards[0]) comes from the layer that set the list
        below = self._below.get(path, []) if path else []
        if below:
            exact = self.sources.get(path)
            return ", ".join(dict.fromkeys([*([exact] if exact else []), *below]))
        parts = path.split(".") if path else []
        while parts:
            found = self.sources.get(".".join(parts))
            if found:
                return found
            parts.pop()
        return DEFAULT_SOURCE


def _is_path_key(key: Any) -> bool:
    """Keys whose string values are file paths, resolved relative to the YAML file that sets them (a key
    inside a list may be anything YAML allows: only string keys name paths)."""
    return isinstance(key, str) and (key == "path" or key.endswith("_path"))


def _resolve_path(key: str, value: Any, base_dir: Path | None, dotted: str = "") -> Any:
    """A relative path under a path key, made absolute against the YAML file's folder; lists of mappings
    (`data.source.sources: [{path, weight}]`) have their path keys resolved too."""
    if base_dir is None:
        return value
    if isinstance(value, list):
        return [{k: _resolve_path(k, v, base_dir) for k, v in item.items()} if isinstance(item, dict) else item
                for item in value]
    if _is_path_key(key) and isinstance(value, str) and not Path(value).is_absolute():
        if dotted in HUB_NAME_KEYS and HUB_NAME.match(value) and not (base_dir / value).exists():
            return value  # a hub name (Qwen/Qwen3-0.6B), not a folder next to the YAML
        return str((base_dir / value).resolve())
    return value


def _merge(target: LayeredDict, layer: dict[str, Any], source: str, prefix: str = "", base_dir: Path | None = None) -> None:
    node = target.data
    for part in prefix.split(".") if prefix else []:
        node = node[part]
    if prefix and node and _swaps_variant(node, layer, prefix):  # another variant: its keys are not the old one's
        target.drop_sources_below(prefix, node)
        node.clear()
        target.set_source(prefix, source)
    for key, value in layer.items():
        if not isinstance(key, str):
            raise ConfigError(ConfigIssue(f"{prefix}.{key}".strip("."), "keys must be strings", key, source))
        if not key or "." in key:  # dotted paths address nested keys; a dot inside one key is ambiguous
            raise ConfigError(ConfigIssue(prefix, "keys must be non-empty and contain no '.'", key, source,
                                          hint="nest the mapping instead of writing a dotted key"))
        dotted = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            if not isinstance(node.get(key), dict):
                node[key] = {}
                target.set_source(dotted, source)
            _merge(target, value, source, dotted, base_dir)
            continue
        replaced = node.get(key)
        if isinstance(replaced, dict):
            target.drop_sources_below(dotted, replaced)
        node[key] = _resolve_path(key, value, base_dir, dotted)
        target.set_source(dotted, source)


def _swaps_variant(node: dict[str, Any], layer: dict[str, Any], prefix: str) -> bool:
    """Whether `layer` gives the union section at `prefix` another `type:` than the one it holds (named, or
    implied by the schema), so it replaces the section instead of deep-merging into the old variant's keys."""
    new = layer.get("type")
    if not isinstance(new, str):
        return False
    old = node.get("type", _implicit_type(prefix.split(".")))
    return old is not None and old != new


def _implicit_type(parts: list[str]) -> str | None:
    """The variant a union section at `parts` means without a `type:` key: the field's default variant, or, for
    an entry of a dict of variants (a loss child), its name when that is a variant's tag."""
    annotation: Any = RunConfig
    field_info = None
    for part in parts:
        field_info = None
        for member in _unwrap(annotation):
            if isinstance(member, type) and issubclass(member, BaseModel) and part in member.model_fields:
                field_info = member.model_fields[part]
                annotation = field_info.annotation
                break
            if typing.get_origin(member) is dict:
                annotation = typing.get_args(member)[1]
                break
        else:
            return None
    tags = variant_tags(annotation)
    if not tags:
        return None
    if field_info is not None:
        return getattr(field_info.get_default(call_default_factory=True), "type", None)
    return parts[-1] if parts[-1] in tags else None


def variant_tags(annotation: Any) -> list[str]:
    """The `type:` tags of the config models in a (discriminated) union annotation; empty when there are none."""
    tags = []
    for member in _unwrap(annotation):
        if isinstance(member, type) and issubclass(member, BaseModel) and "type" in member.model_fields:
            default = member.model_fields["type"].default
            if isinstance(default, str):
                tags.append(default)
    return tags


def _read_yaml(path: Path, source: str) -> dict[str, Any]:
    loaded = parse_yaml(read_config_file(path, source), str(path))
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(
            ConfigIssue("", f"{path} must hold a mapping at the top level", type(loaded).__name__, str(path))
        )
    return loaded


def _load_file(path: Path, target: LayeredDict, chain: tuple[Path, ...], loaded: list[Path]) -> None:
    path = path.resolve()
    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise ConfigError(ConfigIssue(BASE_KEY, f"base files form a cycle: {cycle}", source=str(chain[-1])))
    loaded.append(path)
    if len(loaded) > MAX_CONFIG_FILES:  # base lists that repeat files multiply: 8 x 8 x 8 ... loads
        raise ConfigError(ConfigIssue(BASE_KEY, f"more than {MAX_CONFIG_FILES} config files to read through "
                                      "base: lists", source=str(chain[-1]) if chain else str(path)))
    try:
        layer = _read_yaml(path, str(chain[-1]) if chain else "command line")
    except ConfigError as error:
        if not chain or path.exists():
            raise
        hint = _nearest_file_hint(path, chain[-1])
        raise ConfigError([replace(issue, path=BASE_KEY, hint=hint) for issue in error.issues]) from None
    bases = layer.pop(BASE_KEY, None)
    if bases is not None:
        base_list = [bases] if isinstance(bases, str) else bases
        if not isinstance(base_list, list) or not all(isinstance(b, str) for b in base_list):
            raise ConfigError(
                ConfigIssue(BASE_KEY, "must be a file path or a list of file paths", bases, str(path))
            )
        for base in base_list:
            _load_file(path.parent / base, target, (*chain, path), loaded)
    _merge(target, layer, str(path), base_dir=path.parent)


def _nearest_file_hint(missing: Path, parent: Path) -> str:
    """For a `base:` that names no file: the YAML file near it with the closest name, as the parent would write it."""
    folder = missing.parent if missing.parent.is_dir() else parent.parent
    candidates = {_as_written(file, parent.parent): file.name
                  for pattern in ("*.yaml", "*.yml", "*/*.yaml", "*/*.yml") for file in folder.glob(pattern)
                  if file.resolve() != parent}
    close = difflib.get_close_matches(missing.name, list(candidates.values()), n=1, cutoff=0.5)
    if not close:
        return f"base: paths are relative to {parent.parent}; no YAML file there has a similar name"
    written = next(relative for relative, name in candidates.items() if name == close[0])
    return f"did you mean base: {written}? (paths are relative to the file's folder)"


def _as_written(file: Path, folder: Path) -> str:
    """`file` relative to `folder` when it lies below it, else absolute."""
    relative = os.path.relpath(file, folder)
    return str(file) if relative.startswith("..") else relative


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b.c=value` -> ("a.b.c", yaml value). Values parse as YAML: 3 -> int, [1,2] -> list, null -> None."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(
            ConfigIssue("", f"override {text!r} is not of the form dotted.key=value", source="override",
                        hint="write e.g. model.hidden_size=256")
        )
    try:
        value = parse_yaml(raw, f"override `{text}`") if raw.strip() else ""
    except ConfigError as error:
        raise ConfigError([replace(issue, path=key) for issue in error.issues]) from None
    return key, value


def apply_overrides(target: LayeredDict, overrides: Iterable[str]) -> None:
    for text in overrides:
        key, value = parse_override(text)
        *parents, leaf = key.split(".")
        prefix = ""
        node = target.data
        for part in parents:
            child = node.get(part)
            if not isinstance(child, dict):
                node[part] = {}
                target.set_source(f"{prefix}.{part}".strip("."), f"override `{text}`")
            node = node[part]
            prefix = f"{prefix}.{part}".strip(".")
        _merge(target, {leaf: value}, f"override `{text}`", prefix)


def load_layers(path: str | Path | None, overrides: Iterable[str] = ()) -> LayeredDict:
    """Merge the YAML file (and its bases) and the overrides; defaults come later, from the schema."""
    layered = LayeredDict()
    if path is not None:
        _load_file(Path(path), layered, (), [])
    apply_overrides(layered, overrides)
    return layered


def load_config(path: str | Path | None, overrides: Iterable[str] = ()) -> RunConfig:
    """Resolve and validate a run config; raise `ConfigError` listing every problem with its source."""
    layered = load_layers(path, overrides)
    try:
        config = RunConfig.model_validate(layered.data)
    except ValidationError as error:
        items = error.errors()
        issues = [to_issue(item, layered) for item in items[:MAX_REPORTED_ISSUES]]
        if len(items) > MAX_REPORTED_ISSUES:
            issues.append(ConfigIssue("", f"... and {len(items) - MAX_REPORTED_ISSUES} more problems like these"))
        raise ConfigError(issues) from None
    _record_user_code_folders(config, layered, path)
    _resolve_init_path(config, layered)
    found = [*cross_check(config), *_size_issues(config)]
    issues = [replace(issue, source=layered.source_of(issue.path)) for issue in found]
    if issues:
        raise ConfigError(issues)
    return config


def _record_user_code_folders(config: RunConfig, layered: LayeredDict, path: str | Path | None) -> None:
    """Each section naming user code looks for it in the folder of the file that set it, then in the folder of
    the config given (fastlm/config/user_code.py)."""
    top = [Path(path).resolve().parent] if path is not None else []
    for dotted, section in user_code_sections(config):
        sources = layered.source_of(dotted).split(", ")
        section.set_folders([*(Path(source).parent for source in sources if Path(source).is_file()), *top])


def _resolve_init_path(config: RunConfig, layered: LayeredDict) -> None:
    """run.init_path becomes the local folder it names (fastlm/engine/init_path.py); a fastlm checkpoint also
    brings its tokenizer when data.tokenizer is not set."""
    if config.run.init_path is None:
        return
    try:
        source = resolve_init_path(config.run.init_path)
    except ConfigError as error:
        raise ConfigError([replace(issue, source=layered.source_of(issue.path)) for issue in error.issues]) from None
    config.run.init_path = str(source.path)
    if source.kind == "fastlm" and config.data.tokenizer is None:
        config.data.tokenizer = checkpoint_tokenizer(source.path)


MAX_PARAMETERS = 2**60  # fp64 storage of 2**60 values is 2**63 bytes: the most a torch tensor can address


def _size_issues(config: RunConfig) -> list[ConfigIssue]:
    """A model too large for any tensor to hold would fail inside torch (storage overflow) with a traceback."""
    count = num_parameters(config.model)
    if count < MAX_PARAMETERS:
        return []
    return [ConfigIssue("model", f"{describe_count(count)} parameters is more than a tensor can address "
                        f"({describe_count(MAX_PARAMETERS)})",
                        hint="lower model.hidden_size, model.vocab_size, model.intermediate_size or model.num_layers")]


def to_issue(item: dict[str, Any], layered: LayeredDict, root: type[BaseModel] | None = None) -> ConfigIssue:
    """One pydantic error as a `ConfigIssue`: its dotted path (under `root`, the config class being loaded,
    RunConfig by default), the layer that set the value, and a hint."""
    path, parent_model = _dotted_path(item["loc"], layered.data, root or RunConfig)
    source = layered.source_of(path)
    kind = item["type"]
    if kind == "extra_forbidden":
        leaf = path.rsplit(".", 1)[-1]
        known = sorted(parent_model.model_fields) if parent_model else []
        close = nearest_key(leaf, known)
        hint = f"did you mean '{close}'?" if close else f"known keys here: {', '.join(known)}"
        return ConfigIssue(path, "unknown key", item.get("input"), source, hint)
    if kind == "union_tag_invalid":
        expected = item.get("ctx", {}).get("expected_tags", "")
        return ConfigIssue(path + ".type" if path else "type", "unknown type", item.get("ctx", {}).get("tag"),
                           source, f"use one of {expected}")
    if kind == "union_tag_not_found":
        return ConfigIssue(path, "missing 'type' key", item.get("input"), source,
                           "add a type: key naming the variant")
    message = item["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    value = item.get("input")
    if isinstance(value, dict):  # a whole section: the message names the fields, the dict adds noise
        value = _MISSING
    hint = _hint_for(kind, item)
    if kind == "missing":
        return ConfigIssue(path, "required key is missing", source=source, hint=hint)
    return ConfigIssue(path, message, value, source, hint)


def _hint_for(kind: str, item: dict[str, Any]) -> str | None:
    ctx = item.get("ctx", {})
    if kind in {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}:
        bound = next(iter(ctx.values()), None)
        words = {"greater_than": "above", "greater_than_equal": "at least",
                 "less_than": "below", "less_than_equal": "at most"}
        return f"use a value {words[kind]} {bound}"
    if kind == "literal_error":
        return f"use one of {ctx.get('expected')}"
    if kind in {"int_from_float", "int_parsing"}:
        return _whole_number_hint(item.get("input"))
    if kind == "missing":
        return "add it to the YAML or pass key=value"
    if kind.endswith("_type") or kind.endswith("_parsing"):
        return f"give a value of the expected type ({kind.split('_')[0]})"
    return None


# Names other trainers (HF TrainingArguments, TRL) give to fastlm's keys, where spelling alone cannot tell.
KEY_ALIASES = {"learning_rate": "lr", "max_steps": "steps", "num_train_steps": "steps",
               "gradient_accumulation_steps": "grad_accumulation", "per_device_train_batch_size": "micro_batch_size",
               "batch_size": "micro_batch_size", "max_grad_norm": "grad_clip", "logging_steps": "log_every",
               "eval_steps": "eval_every", "save_steps": "checkpoint_every", "save_total_limit": "keep_checkpoints",
               "max_seq_length": "seq_len", "max_length": "seq_len", "num_generations": "group_size",
               "max_completion_length": "max_new_tokens", "lr_scheduler_type": "decay"}


def nearest_key(given: str, known: list[str]) -> str | None:
    """The known key `given` most likely means: an alias from another trainer (learning_rate -> lr), its initials
    (learning_rate -> lr), else the closest spelling; None when nothing is close."""
    alias = KEY_ALIASES.get(given.lower())
    if alias in known:
        return alias
    initials = "".join(part[0] for part in given.lower().split("_") if part)
    if len(initials) > 1 and initials in known:
        return initials
    close = difflib.get_close_matches(given, known, n=1)
    return close[0] if close else None


def _whole_number_hint(value: Any) -> str:
    """A float (or `1e3`, which YAML reads as a string) where a whole number is expected: the number to write."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return "give a whole number (an integer, e.g. 100)"
    if not math.isfinite(number):
        return "give a whole, finite number (an integer, e.g. 100)"
    if number.is_integer():
        return f"write it as a whole number: {int(number)}"
    return f"this key counts things: give a whole number, e.g. {round(number)}"


def _dotted_path(loc: tuple[Any, ...], data: Any, root: type[BaseModel]) -> tuple[str, type[BaseModel] | None]:
    """Turn a pydantic error location into the user's dotted path (dropping union tags) and find the
    model class (under `root`, the config being loaded) whose fields were expected at the parent of the last element."""
    parts: list[str] = []
    model: Any = root
    parent: type[BaseModel] | None = root
    node = data
    for element in loc:
        if isinstance(node, dict) and element not in node and node.get("type") == element:
            model = _select_variant(model, element)
            continue
        parts.append(str(element))
        parent = model if isinstance(model, type) and issubclass(model, BaseModel) else None
        model = _child_type(model, element)
        node = node.get(element) if isinstance(node, dict) else None
    return ".".join(parts), parent


def _unwrap(annotation: Any) -> list[Any]:
    """Flatten Annotated/Optional/Union into the plain member types."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return [member for arg in typing.get_args(annotation) for member in _unwrap(arg)]
    return [annotation]


def _child_type(model: Any, element: Any) -> Any:
    members = _unwrap(model) if model is not None else []
    for member in members:
        if isinstance(member, type) and issubclass(member, BaseModel) and element in member.model_fields:
            return member.model_fields[element].annotation
        if typing.get_origin(member) is dict:
            return typing.get_args(member)[1]
    return None


def _select_variant(model: Any, tag: str) -> Any:
    for member in _unwrap(model):
        if isinstance(member, type) and issubclass(member, BaseModel):
            type_field = member.model_fields.get("type")
            if type_field is not None and type_field.default == tag:
                return member
    return model


def dump_config(config: RunConfig) -> str:
    """The fully resolved config as YAML (what `fastlm print-config` shows)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
