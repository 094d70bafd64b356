"""Tool calls in the Qwen/Hermes chat format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

This is how transformers' chat templates (Qwen2.5, Qwen3, Hermes) render an assistant's tool calls and how
those models write them; the byte tokenizer's plain-text chat uses the same text. `arguments` may be a
JSON object or a string holding one (some models write the latter).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class MalformedCall:
    """A `<tool_call>` block that is not a call; `reason` is what the model reads back."""

    text: str
    reason: str


def parse_tool_calls(text: str) -> list[ToolCall | MalformedCall]:
    """Every `<tool_call>` block of an assistant message, in order (an unclosed one is not a call)."""
    calls: list[ToolCall | MalformedCall] = []
    for match in TOOL_CALL.finditer(text):
        body = match.group(1).strip()
        try:
            value = json.loads(body)
        except json.JSONDecodeError as error:
            calls.append(MalformedCall(body, f"the tool call is not valid JSON ({error.msg})"))
            continue
        arguments = value.get("arguments", {}) if isinstance(value, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(arguments, dict):
            calls.append(MalformedCall(body, 'a tool call is {"name": "<tool>", "arguments": {...}}'))
            continue
        calls.append(ToolCall(value["name"], arguments))
    return calls


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The text of one call, as Qwen's template renders it."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
