"""`fastlm prepare`'s long-record reader gives the documents the `datasets` path gives: a file that gains one
long record (read record by record) holds the same documents before it as the file without it (read by
`datasets`), and the long one as the trainer would build it."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from fastlm.data.config import HuggingFaceTokenizerConfig
from fastlm.data.long_records import LONG_RECORD_BYTES, RecordSpans, text_paragraphs
from fastlm.data.prepare import PrepareConfig, check_utf8, prepare
from fastlm.data.prepared import TARGETS_FILE, TOKENS_FILE, read_metadata
from fastlm.data.tokenizer import BOS, EOS, build_tokenizer

LONG = "long words, " * (LONG_RECORD_BYTES // 12 + 1)
RECORDS = [{"text": f"record {i}: " + "é😀 word\n" * (i % 5), "prompt": f"{i}+1=", "completion": str(i + 1),
            "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a" * (i % 7 + 1)}]}
           for i in range(30)]
LONG_RECORD = {"text": LONG, "prompt": LONG, "completion": "done", "messages": [{"role": "user", "content": LONG},
                                                                               {"role": "assistant", "content": "ok"}]}
TEXT = "first doc\nstill first\n\n\nsecond doc\r\n\r\nthird  \n\n\n\n\nfourth\r\r" * 4


def _set(directory: Path) -> dict:
    metadata = read_metadata(directory)
    targets = directory / TARGETS_FILE
    return {"tokens": np.fromfile(directory / TOKENS_FILE, dtype=metadata["dtype"]),
            "offsets": np.load(directory / "documents.npy"),
            "targets": np.fromfile(targets, dtype=np.uint8) if targets.exists() else None, "metadata": metadata}


def _prepare(tmp_path: Path, name: str, content: str, suffix: str, **fields) -> dict:
    path = tmp_path / f"{name}{suffix}"
    path.write_text(content, encoding="utf-8")
    assert check_utf8(path, text=suffix == ".txt").holds_long_records() == name.startswith("long")
    return _set(prepare(PrepareConfig(input_path=str(path), output_path=str(tmp_path / f"set-{name}"), **fields)).path)


@pytest.mark.parametrize("fields", [{}, {"prompt_field": "prompt", "completion_field": "completion"},
                                    {"messages_field": "messages"}], ids=["text", "prompt-completion", "messages"])
def test_a_long_jsonl_record_keeps_every_document_as_datasets_reads_it(tmp_path: Path, fields: dict) -> None:
    lines = [json.dumps(record) + "\n" for record in RECORDS]
    short = _prepare(tmp_path, "short", "".join(lines), ".jsonl", **fields)
    long = _prepare(tmp_path, "long", "".join(lines[:20] + [json.dumps(LONG_RECORD) + "\n"] + lines[20:]), ".jsonl",
                    **fields)
    cut = short["offsets"][20]
    added = len(long["tokens"]) - len(short["tokens"])
    assert np.array_equal(long["offsets"], np.concatenate([short["offsets"][:21], short["offsets"][20:] + added]))
    assert np.array_equal(np.delete(long["tokens"], np.s_[cut : cut + added]), short["tokens"])
    if fields:
        assert np.array_equal(np.delete(long["targets"], np.s_[cut : cut + added]), short["targets"])
        assert long["metadata"]["longest_prompted"] == added
    else:
        assert long["targets"] is None and long["tokens"][cut:cut + added].tolist() == [BOS, *LONG.encode(), EOS]


def test_a_long_paragraph_keeps_every_document_as_datasets_reads_it(tmp_path: Path,
                                                                     bpe_dir: Callable[[str], Path]) -> None:
    tokenizer = HuggingFaceTokenizerConfig(path=str(bpe_dir("llama")))
    for fields in ({}, {"tokenizer": tokenizer.model_dump(), "overwrite": True}):
        short = _prepare(tmp_path, "short", TEXT, ".txt", **fields)
        long = _prepare(tmp_path, "long", TEXT + LONG + "\r\n\r\n\ntail\n", ".txt", **fields)
        count = len(short["offsets"])
        assert np.array_equal(long["offsets"][:count], short["offsets"])
        assert np.array_equal(long["tokens"][: len(short["tokens"])], short["tokens"])
        ids = build_tokenizer(tokenizer if fields else None).encode
        expected = ids(LONG, bos=True, eos=True) + ids("\ntail\n", bos=True, eos=True)
        assert long["tokens"][len(short["tokens"]):].tolist() == expected and len(long["offsets"]) == count + 2


def test_text_paragraphs_split_as_datasets_does(tmp_path: Path) -> None:
    """datasets' `sample_by: paragraph`: universal newlines, split at every "\\n\\n", empty pieces dropped."""
    rng = random.Random(0)
    path = tmp_path / "random.txt"
    for _ in range(200):
        path.write_bytes("".join(rng.choice(["a", " ", "\n", "\r", "\r\n", "é"]) for _ in range(rng.randrange(40))).encode())
        expected = [piece for piece in path.read_text(encoding="utf-8").split("\n\n") if piece]
        for chunk_chars in (1, 2, 3, 7, 1 << 20):
            assert list(text_paragraphs(path, chunk_chars)) == expected


@pytest.mark.parametrize("text", [False, True], ids=["lines", "paragraphs"])
def test_record_spans_measure_the_longest_record_across_chunks(text: bool) -> None:
    rng = random.Random(1)
    for _ in range(200):
        data = bytes(rng.choice(b"ab\n\n\r") for _ in range(rng.randrange(1, 60))) + b"end"
        separators = [i for i in range(len(data)) if data[i] == 10 and (
            not text or data[i + 1:i + 2] == b"\n" or data[i + 1:i + 3] == b"\r\n")]
        bounds = [-1, *separators, len(data)]
        expected = max(end - start - 1 for start, end in zip(bounds, bounds[1:]))
        for size in (1, 2, 5, len(data)):
            spans = RecordSpans(text)
            for start in range(0, len(data), size):
                spans.feed(data[start:start + size])
            assert spans.longest_record() == expected, (data, size)


def test_only_long_json_lines_objects_take_the_long_record_reader() -> None:
    for line, long in ((b'{"text": "' + b"x" * LONG_RECORD_BYTES + b'"}\n', True),
                       (b'  [{"text": "' + b"x" * LONG_RECORD_BYTES + b'"}]\n', False),  # one JSON array: datasets
                       (b'{"text": "x"}\n' * (LONG_RECORD_BYTES // 10), False)):
        spans = RecordSpans(text=False)
        spans.feed(line)
        assert spans.holds_long_records() == long
