"""Chat records (TRL conventions): rendered by the tokenizer's template, loss on assistant turns only."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from fastlm.data.config import HuggingFaceTokenizerConfig, JsonlSource
from fastlm.data.datasets import DataError, load_documents
from fastlm.data.tokenizer import BOS, EOS, ByteTokenizer, Tokenizer, build_tokenizer

CONVERSATION = [
    {"role": "system", "content": "Add."},
    {"role": "user", "content": "2+3="},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "4+4="},
    {"role": "assistant", "content": "8"},
]


def _load(path: Path, records: list[dict], tokenizer: Tokenizer, **fields: str) -> list:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return load_documents(JsonlSource(path=str(path), **fields), tokenizer)


def _spans(tokenizer: Tokenizer, tokens: list[int], targets: list[bool]) -> list[str]:
    """The decoded runs of consecutive target tokens."""
    spans, run = [], []
    for token, target in zip(tokens + [-1], targets + [False]):
        if target:
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run, skip_special=False))
            run = []
    return spans


@pytest.mark.parametrize("style", ["llama", "qwen2"])
def test_only_assistant_turns_are_targets(bpe_dir: Callable[[str], Path], tmp_path: Path, style: str) -> None:
    tokenizer = build_tokenizer(HuggingFaceTokenizerConfig(path=str(bpe_dir(style))))
    [document] = _load(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}], tokenizer, messages_field="messages")
    assert tokenizer.decode(document.tokens, skip_special=False) == tokenizer.render_chat(CONVERSATION)
    assert _spans(tokenizer, document.tokens, document.target_mask) == ["5<|im_end|>\n", "8<|im_end|>\n"]
    assert (document.tokens[0] == tokenizer.bos_id) == (style == "llama")  # the template writes Llama's BOS once
    assert document.tokens.count(tokenizer.eos_id) == 5  # one <|im_end|> per turn, no EOS appended


def test_conversational_prompt_completion_trains_the_completion(bpe_dir: Callable[[str], Path], tmp_path: Path) -> None:
    tokenizer = build_tokenizer(HuggingFaceTokenizerConfig(path=str(bpe_dir("qwen2"))))
    record = {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]}
    [document] = _load(tmp_path / "pc.jsonl", [record], tokenizer, prompt_field="prompt", completion_field="completion")
    assert _spans(tokenizer, document.tokens, document.target_mask) == ["8<|im_end|>\n"]


def test_byte_tokenizer_chat_gets_bos_and_a_target_eos(tmp_path: Path) -> None:
    tokenizer = ByteTokenizer()
    [document] = _load(tmp_path / "chat.jsonl", [{"messages": CONVERSATION[1:3]}], tokenizer, messages_field="messages")
    assert document.tokens[0] == BOS and document.tokens[-1] == EOS and document.target_mask[-1]
    assert tokenizer.decode(t for t, m in zip(document.tokens, document.target_mask) if m) == "5\n"


@pytest.mark.parametrize(("messages", "message"), [
    ([{"role": "user", "content": "hi"}], "no assistant message to train on"),
    ([{"role": "robot", "content": "hi"}], "message 0 has role 'robot'"),
    ([{"role": "user"}], "message 0 must be an object with 'role' and 'content'"),
    ("hello", "messages must be a non-empty list"),
])
def test_bad_conversations_name_file_and_line(tmp_path: Path, messages: object, message: str) -> None:
    good = {"messages": CONVERSATION}
    with pytest.raises(DataError, match=rf"chat.jsonl line 2: {message}"):
        _load(tmp_path / "chat.jsonl", [good, {"messages": messages}], ByteTokenizer(), messages_field="messages")
