"""One error type for every config problem, so the CLI can print them all and exit non-zero."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_MISSING: Any = object()


@dataclass(frozen=True)
class ConfigIssue:
    """A single problem: where (dotted path), what was given, where it came from, and how to fix it."""

    path: str
    message: str
    value: Any = _MISSING
    source: str | None = None
    hint: str | None = None

    def __str__(self) -> str:
        parts = [f"{self.path or '<root>'}: {self.message}"]
        if self.value is not _MISSING:
            parts.append(f"got {_short_repr(self.value)}")
        if self.source:
            parts.append(f"from {self.source}")
        text = "; ".join(parts)
        if self.hint:
            text += f". Fix: {self.hint}"
        return text


class ConfigError(ValueError):
    """Raised for any invalid configuration; carries every issue found, not just the first."""

    def __init__(self, issues: list[ConfigIssue] | ConfigIssue | str):
        if isinstance(issues, str):
            issues = [ConfigIssue(path="", message=issues)]
        elif isinstance(issues, ConfigIssue):
            issues = [issues]
        self.issues: list[ConfigIssue] = list(issues)
        super().__init__(self.render())

    def render(self) -> str:
        count = len(self.issues)
        head = f"invalid configuration ({count} problem{'s' if count != 1 else ''}):"
        return "\n".join([head, *(f"  - {issue}" for issue in self.issues)])


def _short_repr(value: Any, limit: int = 80) -> str:
    """The value as written, its middle cut when long: a long path keeps its file name."""
    text = repr(value)
    if len(text) <= limit:
        return text
    head = (limit - 3) // 2
    return text[:head] + "..." + text[len(text) - (limit - 3 - head):]
