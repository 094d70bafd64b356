"""Text and JSONL readers stream (memory: a small multiple of the longest line, not of the file) and
name the file and line of every malformed record, however deep or strange."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from fastlm.data.config import DataConfig, JsonlSource, TextSource
from fastlm.data.datasets import DataError, _paragraphs, jsonl_records
from fastlm.data.eval_source import build_loaders
from fastlm.data.tokenizer import ByteTokenizer

LINE_BYTES = 1 << 20
LINES = 16  # a 16 MiB file whose longest line is 1 MiB


def _peak(consume) -> int:
    tracemalloc.start()
    try:
        consume()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_jsonl_reader_memory_is_bounded_by_the_longest_line(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    with path.open("w", encoding="utf-8") as handle:
        for index in range(LINES):
            handle.write(json.dumps({"text": chr(97 + index % 26) * (LINE_BYTES - 16)}) + "\n")
    peak = _peak(lambda: sum(1 for _ in jsonl_records(path)))
    print(f"jsonl: file {path.stat().st_size / 2**20:.1f} MiB, longest line 1 MiB, reader peak {peak / 2**20:.2f} MiB")
    assert peak < 8 * LINE_BYTES


def test_text_reader_memory_is_bounded_by_the_longest_document(tmp_path: Path) -> None:
    path = tmp_path / "big.txt"
    with path.open("w", encoding="utf-8") as handle:
        for _ in range(LINES):
            handle.write("word " * (LINE_BYTES // 5) + "\n\n")
    peak = _peak(lambda: sum(1 for _ in _paragraphs(path)))
    print(f"text: file {path.stat().st_size / 2**20:.1f} MiB, longest document 1 MiB, reader peak {peak / 2**20:.2f} MiB")
    assert peak < 8 * LINE_BYTES


GOOD = json.dumps({"text": "a fine document"}) + "\n"
MALFORMED = {
    "100k-deep nesting": ('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}", "JSON nested too deeply to read"),
    "lone surrogate": ('{"text": "half a pair \\ud800 here"}', r"holds a lone surrogate"),
    "lone surrogate in a key": ('{"te\\udfffxt": "x", "text": "y"}', r"holds a lone surrogate"),
    "invalid UTF-8": (b'{"text": "\xc3\x28"}', "not valid UTF-8 at byte"),
    "not an object": ("[1, 2]", "expected a JSON object, got list"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_jsonl_record_names_file_and_line(tmp_path: Path, case: str) -> None:
    line, message = MALFORMED[case]
    path = tmp_path / "data.jsonl"
    path.write_bytes(GOOD.encode() * 2 + (line if isinstance(line, bytes) else line.encode()) + b"\n" + GOOD.encode())
    config = DataConfig(source=JsonlSource(path=str(path)), seq_len=16, micro_batch_size=2, eval_fraction=0.0)
    with pytest.raises(DataError, match=f"{path} line 3: {message}"):
        build_loaders(config, seed=0, tokenizer=ByteTokenizer())


def test_surrogate_pairs_are_text_not_errors(tmp_path: Path) -> None:
    path = tmp_path / "emoji.jsonl"
    path.write_text('{"text": "smile \\ud83d\\ude00"}\n' + GOOD, encoding="utf-8")
    assert [record["text"] for _, record in jsonl_records(path)][0] == "smile \U0001F600"


def test_text_documents_keep_their_line_for_errors(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"first document\n\n  \nsecond\r\ndocument\n\nthird \xff\n")
    with pytest.raises(DataError, match=f"{path} line 7: not valid UTF-8 at byte 43"):
        build_loaders(
            DataConfig(source=TextSource(path=str(path)), seq_len=16, micro_batch_size=2), seed=0, tokenizer=ByteTokenizer()
        )
    path.write_bytes(b"first document\n\n  \nsecond\r\ndocument\n")
    assert [text for _, text in _paragraphs(path)] == ["first document", "second\r\ndocument"]
