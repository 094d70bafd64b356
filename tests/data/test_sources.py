"""File sources: blank-line text, JSONL text and prompt/completion, and errors that name file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastlm.data.config import JsonlSource, TextSource
from fastlm.data.datasets import DataError, load_documents
from fastlm.data.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()


def test_text_source_splits_on_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_text("first doc\nstill first\n\n  \nsecond doc\n", encoding="utf-8")
    docs = load_documents(TextSource(path=str(path)), TOKENIZER)
    assert [TOKENIZER.decode(d.tokens) for d in docs] == ["first doc\nstill first", "second doc"]


def test_jsonl_prompt_completion_masks_prompt(tmp_path: Path) -> None:
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"q": "2+2=", "a": "4"}) + "\n\n" + json.dumps({"q": "x", "a": "y"}) + "\n")
    docs = load_documents(JsonlSource(path=str(path), prompt_field="q", completion_field="a"), TOKENIZER)
    assert len(docs) == 2
    assert docs[0].target_mask == [False] * 5 + [True] * 2  # BOS + "2+2=" | "4" + EOS


@pytest.mark.parametrize(
    ("content", "source_kwargs", "message"),
    [
        ('{"text": "ok"}\n{"text": broken}\n', {}, r"line 2: invalid JSON"),
        ('{"text": "ok"}\n{"body": "x"}\n', {}, r"line 2: missing field 'text'"),
        ('{"text": 3}\n', {}, r"line 1: field 'text' must be a string"),
        ('["a"]\n', {}, r"line 1: expected a JSON object"),
        ('{"q": "a"}\n', {"prompt_field": "q", "completion_field": "a"}, r"line 1: missing field 'a'"),
        ("", {}, r"no documents"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path: Path, content: str, source_kwargs: dict, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=message) as info:
        load_documents(JsonlSource(path=str(path), **source_kwargs), TOKENIZER)
    assert str(path) in str(info.value)


def test_missing_and_empty_text_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        load_documents(TextSource(path=str(tmp_path / "nope.txt")), TOKENIZER)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n \n")
    with pytest.raises(DataError, match=f"{empty}: no documents"):
        load_documents(TextSource(path=str(empty)), TOKENIZER)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9")
    with pytest.raises(DataError, match="not valid UTF-8 at byte 3"):
        load_documents(TextSource(path=str(bad)), TOKENIZER)
