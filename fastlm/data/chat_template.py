"""Chat templates are user code (a Jinja program from a tokenizer folder): they render under limits.

transformers compiles a template in its hardened sandbox (no attribute escapes, no `_` names on
namespaces); fastlm renders through an overlay of that same environment that adds limits a sandbox lacks:

- time: every call, loop step of `range` and output chunk checks a deadline (`TIME_LIMIT_S`), so a nested
  `range(100000)` loop ends in seconds;
- size: `*` and `**` are checked before they run (`'x' * 10**10` would allocate 10 GB at once), and the
  output may hold at most `MAX_OUTPUT_CHARS` plus 4 characters per character of the conversation.

The arguments are those of `tokenizer.apply_chat_template` (the messages, the generation prompt flag, the
special tokens), so the text is the same. Any failure (a limit, `raise_exception(...)`, a syntax error, an
undefined name) is a `TemplateError` whose message is one line; the caller names the template file.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

TIME_LIMIT_S = 10.0
MAX_OUTPUT_CHARS = 4 << 20
MAX_POWER_BITS = 1 << 16  # `a ** b` may produce an int of at most this many bits

_deadline: contextvars.ContextVar[float] = contextvars.ContextVar("chat_template_deadline", default=float("inf"))
_max_items: contextvars.ContextVar[int] = contextvars.ContextVar("chat_template_max_items", default=MAX_OUTPUT_CHARS)


class TemplateError(ValueError):
    """The template failed or passed a limit; the message is one line (the caller adds the file)."""


def _check_time() -> None:
    if time.monotonic() > _deadline.get():
        raise TemplateError(f"rendering took longer than {TIME_LIMIT_S:g} s (a loop too long for a chat template?)")


def _repeat_size(left: Any, right: Any) -> int:
    """Items `left * right` would build (0 for numbers)."""
    for sequence, count in ((left, right), (right, left)):
        if isinstance(sequence, (str, list, tuple)) and isinstance(count, int):
            return len(sequence) * max(count, 0)
    return 0


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """Checks the deadline on every call and `*`/`**` sizes before they run (see the module docstring)."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_time()
        if operator == "*" and _repeat_size(left, right) > _max_items.get():
            raise TemplateError(f"'*' would build a value of {_repeat_size(left, right):,} items, more than the "
                                f"{_max_items.get():,} a rendering may hold")
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                and right * max(abs(left).bit_length(), 1) > MAX_POWER_BITS:
            raise TemplateError(f"'**' would build an integer of about {right * abs(left).bit_length():,} bits")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's signature
        _check_time()
        return super().call(__context, __obj, *args, **kwargs)


def _bounded_range(*args: int) -> Iterator[int]:
    """jinja's sandboxed `range` (at most 100,000 items), checking the deadline as it goes."""
    from jinja2.sandbox import safe_range

    for index, value in enumerate(safe_range(*args)):
        if not index % 1024:
            _check_time()
        yield value


@lru_cache(maxsize=16)
def _compiled(source: str) -> Any:
    """The template compiled in transformers' sandbox environment, overlaid with the limits."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    base = _compile_jinja_template("").environment  # its sandbox, set up as for any template; never compile
    environment = base.overlay()  # `source` there: jinja folds constants, `'x' * 10**10` included, at compile time
    environment.__class__ = _BoundedEnvironment
    environment.globals = {**base.globals, "range": _bounded_range}
    return environment.from_string(source)


def render_template(source: str, messages: Sequence[dict[str, str]], add_generation_prompt: bool,
                    special_tokens: dict[str, Any]) -> str:
    """The conversation as `source` renders it, under the limits; a `TemplateError` (one line) otherwise."""
    budget = MAX_OUTPUT_CHARS + 4 * sum(len(m.get("content", "")) for m in messages)
    deadline_token = _deadline.set(time.monotonic() + TIME_LIMIT_S)
    items_token = _max_items.set(budget)
    try:
        template = _compiled(source)
        pieces, size = [], 0
        for piece in template.generate(**special_tokens, messages=[dict(m) for m in messages], tools=None,
                                       documents=None, add_generation_prompt=add_generation_prompt):
            size += len(piece)
            if size > budget:
                raise TemplateError(f"the rendering passed {budget:,} characters (the limit for this conversation)")
            _check_time()
            pieces.append(piece)
        return "".join(pieces)
    except TemplateError:
        raise
    except RecursionError:
        raise TemplateError("recursion too deep") from None
    except MemoryError:
        raise TemplateError("ran out of memory") from None
    except Exception as error:  # noqa: BLE001 - user code: raise_exception, syntax, undefined names, type errors
        text = " ".join(str(error).split())[:300]
        raise TemplateError(f"{type(error).__name__}: {text}") from None
    finally:
        _deadline.reset(deadline_token)
        _max_items.reset(items_token)
