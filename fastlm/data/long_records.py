"""`fastlm prepare`'s reader for files with long records: one record in memory at a time, held once.

`datasets` reads a file in blocks that grow until the longest record fits, and `Dataset.map` hands records
to the tokenizer through Arrow and Python lists: a 50 MB line took 29 bytes a byte of it. A JSON Lines or
text file with a record of `LONG_RECORD_BYTES` or more is read here instead, record by record, and tokenized
in this process into `Document`s (a plain text one holds its tokenizer's compact ids, `TokenStream`), which
prepare writes a chunk at a time. The documents are those of the `datasets` path: text files split as its
`sample_by: paragraph` does (universal newlines, split at blank lines, kept as they are), rows numbered
alike; JSON Lines records as the trainer reads them (`jsonl_records`, `record_document`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from fastlm.data.config import RecordFields
from fastlm.data.datasets import Document, jsonl_records, record_document, string_field, text_document
from fastlm.data.tokenizer import Tokenizer

LONG_RECORD_BYTES = 1 << 20
_LF, _CR = 10, 13


class RecordSpans:
    """The longest record of a file fed chunk by chunk, in bytes: JSON Lines records end at a line end, text
    records at a blank line (LF LF or LF CR LF; a file of CR-only line ends counts as one record: never less
    than the truth, so a long record is never missed). Also whether the file starts with a JSON object."""

    def __init__(self, text: bool) -> None:
        self.text = text
        self.size = 0  # bytes fed
        self.record_start = 0  # where the current record began
        self.longest = 0
        self.tail = b""  # a text file's last 2 bytes, whose separator is decided with the next chunk
        self.first_byte = b""

    def feed(self, chunk: bytes) -> None:
        if not self.first_byte and chunk.lstrip():
            self.first_byte = chunk.lstrip()[:1]
        window = np.frombuffer(self.tail + chunk, dtype=np.uint8)
        base = self.size - len(self.tail)
        self.size += len(chunk)
        if self.text:
            decided = window[:-2] if len(window) > 2 else window[:0]
            lf = np.flatnonzero(decided == _LF)
            ends = lf[(window[lf + 1] == _LF) | ((window[lf + 1] == _CR) & (window[lf + 2] == _LF))]
            self.tail = bytes(window[len(decided):])
        else:
            ends = np.flatnonzero(window == _LF)
        if len(ends):
            starts = np.concatenate([[self.record_start], base + ends[:-1] + 1])
            self.longest = max(self.longest, int((base + ends - starts).max()))
            self.record_start = base + int(ends[-1]) + 1

    def longest_record(self) -> int:
        return max(self.longest, self.size - self.record_start)

    def holds_long_records(self) -> bool:
        """Read with `long_record_documents`: a record of LONG_RECORD_BYTES or more, in a text file or JSON Lines
        (a `.json` file holding one JSON array is left to `datasets`)."""
        return self.longest_record() >= LONG_RECORD_BYTES and (self.text or self.first_byte == b"{")


def text_paragraphs(path: Path, chunk_chars: int = 1 << 20) -> Iterator[str]:
    """The records of `datasets`' text reader with `sample_by: paragraph`: the file with universal newlines, split
    at every "\\n\\n", empty pieces dropped, each kept as it is. A paragraph is joined from its pieces once."""
    pieces: list[str] = []
    held = ""  # a piece's last "\n", which may begin a separator the next chunk ends
    with path.open(encoding="utf-8") as handle:
        while chunk := handle.read(chunk_chars):
            parts = (held + chunk).split("\n\n")
            last = parts.pop()
            for part in parts:
                pieces.append(part)
                if paragraph := _joined(pieces):
                    yield paragraph
            held = "\n" if last.endswith("\n") else ""
            pieces.append(last[: len(last) - len(held)])
    pieces.append(held)
    if paragraph := _joined(pieces):
        yield paragraph


def _joined(pieces: list[str]) -> str:
    text = "".join(pieces)
    pieces.clear()
    return text


def long_record_documents(path: Path, text: bool, fields: RecordFields, tokenizer: Tokenizer) -> Iterator[Document]:
    """Every record of the file as a `Document`, streamed (errors name the file and the row or line)."""
    if text:
        for row, paragraph in enumerate(text_paragraphs(path), start=1):
            where = f"{path} row {row}"
            yield text_document(tokenizer, string_field({"text": paragraph}, "text", where), where)
        return
    for line, record in jsonl_records(path):
        yield record_document(record, fields, tokenizer, f"{path} line {line}")
