"""Layered config resolution: defaults < YAML (with `base:` inheritance) < CLI overrides.

Every leaf value remembers where it came from (a file, or an override), so a validation error can
say "model.hidden_size: ... from configs/tiny.yaml" instead of only "invalid".
"""

from __future__ import annotations

import difflib
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

import yaml
from pydantic import BaseModel, ValidationError

from fastlm.run_config.checks import cross_check
from fastlm.config.errors import _MISSING, ConfigError, ConfigIssue
from fastlm.run_config.schema import RunConfig
from fastlm.config.yaml_reader import parse_yaml, read_config_file
from fastlm.models.build import describe_count, num_parameters

BASE_KEY = "base"
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


def _resolve_path(key: str, value: Any, base_dir: Path | None) -> Any:
    """A relative path under a path key, made absolute against the YAML file's folder; lists of mappings
    (`data.source.sources: [{path, weight}]`) have their path keys resolved too."""
    if base_dir is None:
        return value
    if isinstance(value, list):
        return [{k: _resolve_path(k, v, base_dir) for k, v in item.items()} if isinstance(item, dict) else item
                for item in value]
    if _is_path_key(key) and isinstance(value, str) and not Path(value).is_absolute():
        return str((base_dir / value).resolve())
    return value


def _merge(target: LayeredDict, layer: dict[str, Any], source: str, prefix: str = "", base_dir: Path | None = None) -> None:
    node = target.data
    for part in prefix.split(".") if prefix else []:
        node = node[part]
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
        node[key] = _resolve_path(key, value, base_dir)
        target.set_source(dotted, source)


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
    layer = _read_yaml(path, str(chain[-1]) if chain else "command line")
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
        issues = [_to_issue(item, layered) for item in items[:MAX_REPORTED_ISSUES]]
        if len(items) > MAX_REPORTED_ISSUES:
            issues.append(ConfigIssue("", f"... and {len(items) - MAX_REPORTED_ISSUES} more problems like these"))
        raise ConfigError(issues) from None
    found = [*cross_check(config), *_size_issues(config)]
    issues = [replace(issue, source=layered.source_of(issue.path)) for issue in found]
    if issues:
        raise ConfigError(issues)
    return config


MAX_PARAMETERS = 2**60  # fp64 storage of 2**60 values is 2**63 bytes: the most a torch tensor can address


def _size_issues(config: RunConfig) -> list[ConfigIssue]:
    """A model too large for any tensor to hold would fail inside torch (storage overflow) with a traceback."""
    count = num_parameters(config.model)
    if count < MAX_PARAMETERS:
        return []
    return [ConfigIssue("model", f"{describe_count(count)} parameters is more than a tensor can address "
                        f"({describe_count(MAX_PARAMETERS)})",
                        hint="lower model.hidden_size, model.vocab_size, model.intermediate_size or model.num_layers")]


def _to_issue(item: dict[str, Any], layered: LayeredDict, root: type[BaseModel] | None = None) -> ConfigIssue:
    path, parent_model = _dotted_path(item["loc"], layered.data, root or RunConfig)
    source = layered.source_of(path)
    kind = item["type"]
    if kind == "extra_forbidden":
        leaf = path.rsplit(".", 1)[-1]
        known = sorted(parent_model.model_fields) if parent_model else []
        close = difflib.get_close_matches(leaf, known, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"known keys here: {', '.join(known)}"
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
    if kind == "missing":
        return "add it to the YAML or pass key=value"
    if kind.endswith("_type") or kind.endswith("_parsing"):
        return f"give a value of the expected type ({kind.split('_')[0]})"
    return None


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
