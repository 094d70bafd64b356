"""One-line descriptions of errors for notes that must not print a traceback."""

from __future__ import annotations


def first_line(error: BaseException) -> str:
    """The root cause's type and first line (dynamo wraps backend errors in BackendCompilerFailed)."""
    while (inner := getattr(error, "inner_exception", None) or error.__cause__) is not None:
        error = inner
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200]}" if text else type(error).__name__
