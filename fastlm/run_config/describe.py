"""`fastlm print-config --describe`: the resolved config as YAML with each field's description as a comment."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel

INDENT = "  "


def describe_config(config: BaseModel) -> str:
    """Every field of the resolved config, its value, and (as a `#` comment) what the schema says it means.
    The output is YAML that loads back to the same config."""
    return "".join(_lines(config, 0))


def _lines(model: BaseModel, depth: int) -> list[str]:
    dumped = model.model_dump(mode="json")
    lines: list[str] = []
    for name, field in type(model).model_fields.items():
        comment = f"  # {' '.join(field.description.split())}" if field.description else ""
        lines += _entry(name, getattr(model, name), dumped[name], comment, depth)
    return lines


def _entry(key: str, value: Any, dumped: Any, comment: str, depth: int) -> list[str]:
    """A section opens a nested block (a dict of sections too, e.g. loss children); anything else is one line."""
    pad = INDENT * depth
    if isinstance(value, BaseModel):
        return [f"{pad}{key}:{comment}\n", *_lines(value, depth + 1)]
    if isinstance(value, dict) and value and all(isinstance(item, BaseModel) for item in value.values()):
        lines = [f"{pad}{key}:{comment}\n"]
        for name, item in value.items():
            lines += _entry(name, item, dumped[name], "", depth + 1)
        return lines
    text = yaml.safe_dump(dumped, default_flow_style=True, width=10**6).strip()
    text = text.removesuffix("...").strip()  # a bare scalar document ends with '...'
    return [f"{pad}{key}: {text}{comment}\n"]
