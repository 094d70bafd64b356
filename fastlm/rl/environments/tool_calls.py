"""Tool calls in the Qwen/Hermes chat format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

This is how transformers' chat templates (Qwen2.5, Qwen3, Hermes) render an assistant's tool calls and how
those models write them; the byte tokenizer's plain-text chat uses the same text. `arguments` may be a
JSON object or a string holding one (some models write the latter).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class MalformedCall:
    """A `<tool_call>` block that is not a call; `reason` is what the model reads back."""

    text: str
    reason: str


def _blocks(text: str) -> Iterator[str]:
    """The text between each `<tool_call>` and the first `</tool_call>` after it, in one pass (each search
    starts where the last ended; with no closing tag left, no later block can close either)."""
    position = 0
    while (start := text.find(OPEN, position)) >= 0:
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            return
        yield text[start + len(OPEN) : end]
        position = end + len(CLOSE)


def _json(text: str) -> tuple[Any, str | None]:
    """(value, None), or (None, why) for text that is not JSON a parser can hold: model output is data, so
    too deep a nesting or an integer past Python's digit limit is a malformed call, never an exception."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as error:
        return None, error.msg
    except (ValueError, RecursionError, MemoryError) as error:  # digits past the int limit, nesting
        return None, type(error).__name__


def parse_tool_calls(text: str) -> list[ToolCall | MalformedCall]:
    """Every `<tool_call>` block of an assistant message, in order (an unclosed one is not a call); linear in
    the text's length, and any block that does not parse is a `MalformedCall`."""
    calls: list[ToolCall | MalformedCall] = []
    for block in _blocks(text):
        body = block.strip()
        value, failure = _json(body)
        if failure is not None:
            calls.append(MalformedCall(body, f"the tool call is not valid JSON ({failure})"))
            continue
        arguments = value.get("arguments", {}) if isinstance(value, dict) else None
        if isinstance(arguments, str):
            arguments, _ = _json(arguments)
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(arguments, dict):
            calls.append(MalformedCall(body, 'a tool call is {"name": "<tool>", "arguments": {...}}'))
            continue
        calls.append(ToolCall(value["name"], arguments))
    return calls


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The text of one call, as Qwen's template renders it."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
