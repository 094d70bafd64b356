"""Conversations (TRL's `messages` format) -> token ids with a target flag per token: loss on assistant turns only.

The tokenizer's chat template renders growing prefixes of the conversation; each rendering must extend
the previous one. What an assistant turn adds after the generation prompt (its content and the
template's end-of-turn tokens) is a target; system/user turns and the generation prompts are not. Each
piece is encoded on its own, which is exactly how generation sees it: the prompt rendered with the
generation prompt, then the model's tokens. BOS is prepended when the tokenizer has one and the template
did not write it; EOS is appended (a target) after the last assistant turn when the template did not
write it, so a model learns to stop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastlm.data.tokenizer import Message, Tokenizer

ROLES = ("system", "user", "assistant", "tool")


class ChatError(ValueError):
    """A malformed conversation; the caller adds the file and line."""


def check_messages(messages: Any) -> list[Message]:
    """A list of {"role", "content"} objects with known roles and string contents, else a `ChatError`."""
    if not isinstance(messages, list) or not messages:
        raise ChatError(f"messages must be a non-empty list of {{'role', 'content'}} objects, got {type(messages).__name__}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not {"role", "content"} <= set(message):
            raise ChatError(f"message {index} must be an object with 'role' and 'content', got {message!r:.80}")
        if message["role"] not in ROLES:
            raise ChatError(f"message {index} has role {message['role']!r}; expected one of {list(ROLES)}")
        if not isinstance(message["content"], str):
            raise ChatError(f"message {index} content must be a string, got {type(message['content']).__name__}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _extend(rendered: str, longer: str, index: int) -> str:
    if not longer.startswith(rendered):
        raise ChatError(
            f"the chat template does not render message {index} by appending to the conversation before it, so "
            "assistant turns cannot be told apart; use a template that renders turns in order"
        )
    return longer[len(rendered):]


def _needs_bos(tokenizer: Tokenizer, tokens: list[int]) -> bool:
    return tokenizer.bos_id is not None and (not tokens or tokens[0] != tokenizer.bos_id)


def encode_chat_prompt(tokenizer: Tokenizer, messages: Sequence[Message]) -> list[int]:
    """The ids a model trained by `encode_chat` continues from: the conversation and the generation prompt."""
    tokens = tokenizer.encode(tokenizer.render_chat(messages, add_generation_prompt=True))
    return ([tokenizer.bos_id] if _needs_bos(tokenizer, tokens) else []) + tokens


def encode_chat(tokenizer: Tokenizer, messages: Sequence[Message], trainable_from: int = 0) -> tuple[list[int], list[bool]]:
    """Token ids and target flags of a conversation; assistant messages at index >= `trainable_from` are targets."""
    tokens: list[int] = []
    targets: list[bool] = []
    rendered = ""
    last_target: list[int] = []
    for index, message in enumerate(messages):
        pieces: list[tuple[str, bool]] = []
        if message["role"] == "assistant":
            prompt = tokenizer.render_chat(messages[:index], add_generation_prompt=True)
            pieces.append((_extend(rendered, prompt, index), False))
            rendered = prompt
        full = tokenizer.render_chat(messages[: index + 1])
        trainable = message["role"] == "assistant" and index >= trainable_from
        pieces.append((_extend(rendered, full, index), trainable))
        rendered = full
        for text, target in pieces:
            ids = tokenizer.encode(text) if text else []
            tokens += ids
            targets += [target] * len(ids)
            if target:
                last_target = ids
    if not any(targets):
        raise ChatError("no assistant message to train on (loss is only on assistant turns)")
    if _needs_bos(tokenizer, tokens):
        tokens, targets = [tokenizer.bos_id] + tokens, [False] + targets
    if messages[-1]["role"] == "assistant" and tokenizer.eos_id not in last_target:
        tokens, targets = tokens + [tokenizer.eos_id], targets + [True]
    return tokens, targets
