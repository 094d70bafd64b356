"""Documents from a configured source, tokenized and packed into fixed rows with document ids.

Every document becomes BOS + its tokens + EOS (the run's tokenizer; BOS only if it has one). Documents are shuffled once
by seed, split into train and eval, then laid end to end and cut into rows of seq_len + 1 tokens; a document crossing a
row boundary is split, and each piece gets its own id (attention and labels never cross a piece boundary).

Hostile files fail early with the file and line: invalid UTF-8 or JSON, missing or non-string fields,
empty documents, and prompt + completion records too long for one row (a split would train the
completion without its prompt). Long plain-text documents are split across rows by design.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TypeVar

import numpy as np
import torch

from fastlm.data.chat import ChatError, check_messages, encode_chat
from fastlm.data.config import DataSource, GeneratedSource, JsonlSource, RecordFields, TextSource
from fastlm.data.corpus import generate_documents
from fastlm.data.token_stream import StreamRows, TokenStream
from fastlm.data.tokenizer import Tokenizer, TokenizerError


class DataError(ValueError):
    """Bad training data; the message names the file (and line) to fix."""


@dataclass(frozen=True)
class Document:
    """Token ids and, per token, whether it may be a training target (False for SFT prompts; None: every token
    is). Plain text is a `TokenStream` (about one byte a token for bytes, however long the text)."""

    tokens: list[int] | TokenStream
    target_mask: list[bool] | None
    origin: str = ""  # "file line N", for errors found after loading (packing)

    @property
    def is_prompted(self) -> bool:
        """Part of it is never a target (an SFT prompt): it must fit one row to keep its context."""
        return self.target_mask is not None and not all(self.target_mask)


class Rows(Protocol):
    """Packed rows of seq_len + 1 tokens as `BatchLoader` and the size checks read them."""

    def __len__(self) -> int: ...

    def take(self, picks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, document-piece ids, target flags, padding flags) of rows `picks`, each (len(picks), seq_len + 1)."""
        ...


@dataclass(frozen=True)
class PackedRows:
    """(rows, seq_len + 1) tensors: tokens, document-piece ids, target flags (False = never a label) and
    padding flags (True past a row's data)."""

    tokens: torch.Tensor
    document_ids: torch.Tensor
    target_mask: torch.Tensor
    padding: torch.Tensor

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def take(self, picks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, document ids, target flags, padding flags) of rows `picks` (the interface `BatchLoader` reads
        rows through)."""
        return self.tokens[picks], self.document_ids[picks], self.target_mask[picks], self.padding[picks]


def text_document(tokenizer: Tokenizer, text: str, origin: str = "") -> Document:
    """BOS (if the tokenizer has one) + the text's ids + EOS, every token a target."""
    head = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    return Document(TokenStream.framed(head, tokenizer.encode_array(text), [tokenizer.eos_id]), None, origin)


def _prompt_document(tokenizer: Tokenizer, prompt: str, completion: str, origin: str = "") -> Document:
    """BOS + prompt is never a target; the completion and EOS are."""
    head = tokenizer.encode(prompt, bos=True)
    tail = tokenizer.encode(completion, eos=True)
    return Document(head + tail, [False] * len(head) + [True] * len(tail), origin)


def read_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line with its newline) of a UTF-8 file, streamed: memory holds one line at a time, as a str
    only (neither the raw bytes nor a reference of this reader's own outlive the handing over, so a consumer that
    drops the line frees it). Invalid UTF-8 is a `DataError` naming the line and byte."""
    if not path.is_file():
        raise DataError(f"{path}: data file not found")
    with path.open("rb") as handle:
        number = 0
        while handle.peek(1):
            number += 1
            yield number, _decoded_line(handle, path, number)


def _decoded_line(handle: BinaryIO, path: Path, number: int) -> str:
    raw = handle.readline()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        start = handle.tell() - len(raw)
        raise DataError(f"{path} line {number}: not valid UTF-8 at byte {start + error.start}") from None


def _paragraphs(path: Path) -> Iterator[tuple[int, str]]:
    """(first line, text) of every blank-line-separated document, streamed; a paragraph is held once (its
    lines are let go as it is joined)."""
    lines: list[str] = []
    first = 0
    for number, line in itertools.chain(read_lines(path), [(0, "\n")]):  # a last blank line ends the last paragraph
        if not line.isspace():
            first = first or number
            lines.append(line)
        elif lines:
            yield first, _joined(lines)
            first = 0


def _joined(lines: list[str]) -> str:
    """The paragraph of `lines`, stripped; the list is emptied."""
    text = "".join(lines)
    lines.clear()
    return text.strip()


def _text_documents(source: TextSource, tokenizer: Tokenizer) -> list[Document]:
    path = Path(source.path)
    documents = [text_document(tokenizer, text, f"{path} line {line}") for line, text in _paragraphs(path)]
    if not documents:
        raise DataError(f"{path}: no documents (the file is empty or only whitespace)")
    return documents


def _field(record: dict, name: str, where: str) -> Any:
    if name not in record:
        raise DataError(f"{where}: missing field '{name}' (keys: {sorted(record)}); name the right field in the "
                        "data config (text_field, prompt_field, completion_field, messages_field)")
    return record[name]


def string_field(record: dict, name: str, where: str, allow_empty: bool = False) -> str:
    value = _field(record, name, where)
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{name}' must be a string, got {type(value).__name__}")
    if not allow_empty and (not value or value.isspace()):  # (strip() would copy a long text)
        raise DataError(f"{where}: field '{name}' is empty (an empty document trains on nothing)")
    return value


def _holds_lone_surrogate(value: Any) -> bool:
    """JSON may escape half a UTF-16 pair (`"\\ud800"`); Python decodes it into a str no encoder accepts."""
    if isinstance(value, str):
        if value.isascii():  # the common case, without encoding a copy of a long text
            return False
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_holds_lone_surrogate(key) or _holds_lone_surrogate(item) for key, item in value.items())
    if isinstance(value, list):
        return any(_holds_lone_surrogate(item) for item in value)
    return False


def _jsonl_field(record: dict, name: str, path: Path, line: int, allow_empty: bool = False) -> str:
    return string_field(record, name, f"{path} line {line}", allow_empty)


def _chat_document(tokenizer: Tokenizer, messages: Any, where: str, trainable_from: int = 0) -> Document:
    try:
        tokens, targets = encode_chat(tokenizer, check_messages(messages), trainable_from)
    except (ChatError, TokenizerError) as error:  # a template failure names its file; `where` names the record
        raise DataError(f"{where}: {error}") from None
    return Document(tokens, targets, where)


def record_document(record: dict, fields: RecordFields, tokenizer: Tokenizer, where: str) -> Document:
    """One record (a JSONL line, a Parquet/CSV row) -> a Document, as `RecordFields` describes; errors name `where`."""
    if fields.messages_field is not None:
        return _chat_document(tokenizer, _field(record, fields.messages_field, where), where)
    if fields.prompt_field is not None and fields.completion_field is not None:
        prompt, completion = _field(record, fields.prompt_field, where), _field(record, fields.completion_field, where)
        if isinstance(prompt, list) and isinstance(completion, list):  # TRL's conversational prompt/completion
            return _chat_document(tokenizer, prompt + completion, where, trainable_from=len(prompt))
        prompt = string_field(record, fields.prompt_field, where, allow_empty=True)
        completion = string_field(record, fields.completion_field, where)
        return _prompt_document(tokenizer, prompt, completion, where)
    return text_document(tokenizer, string_field(record, fields.text_field, where), where)


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # only such an escape can produce a lone surrogate


def jsonl_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line, streamed; bad UTF-8, bad JSON, JSON nested too deeply
    to parse, a lone surrogate or a non-object line is a `DataError` naming the file and line. Shared by every
    JSONL reader (documents, pairs, offline RL)."""
    for line_number, line in read_lines(path):
        if line.isspace():
            continue
        try:
            record = json.loads(line)
            surrogate = _SURROGATE_ESCAPE.search(line) is not None and _holds_lone_surrogate(record)
        except json.JSONDecodeError as error:
            raise DataError(f"{path} line {line_number}: invalid JSON ({error.msg} at column {error.colno})") from None
        except RecursionError:
            raise DataError(f"{path} line {line_number}: JSON nested too deeply to read") from None
        if not isinstance(record, dict):
            raise DataError(f"{path} line {line_number}: expected a JSON object, got {type(record).__name__}")
        if surrogate:
            raise DataError(f"{path} line {line_number}: holds a lone surrogate (an unpaired \\ud800-\\udfff escape), "
                            "which is not text")
        del line  # a long line is let go before its record is used
        yield line_number, record


def _jsonl_documents(source: JsonlSource, tokenizer: Tokenizer) -> list[Document]:
    path = Path(source.path)
    documents = []
    for line_number, record in jsonl_records(path):
        documents.append(record_document(record, source, tokenizer, f"{path} line {line_number}"))
    if not documents:
        raise DataError(f"{path}: no documents (the file is empty)")
    return documents


def load_documents(source: DataSource, tokenizer: Tokenizer) -> list[Document]:
    """Every document of the source, tokenized, in file (or generation) order."""
    if isinstance(source, GeneratedSource):
        return [text_document(tokenizer, text) for text in generate_documents(source.num_documents, source.seed)]
    if isinstance(source, TextSource):
        return _text_documents(source, tokenizer)
    if isinstance(source, JsonlSource):
        return _jsonl_documents(source, tokenizer)
    raise DataError(f"unknown data source type {type(source).__name__}")


Item = TypeVar("Item")  # a Document, or a preference pair (kept whole when split)


def split_documents(documents: list[Item], eval_fraction: float, seed: int) -> tuple[list[Item], list[Item]]:
    """Shuffle by seed, hold out ceil(n * eval_fraction) documents for eval; train always keeps one."""
    order = list(range(len(documents)))
    random.Random(seed).shuffle(order)
    held_out = min(math.ceil(len(documents) * eval_fraction), len(documents) - 1) if eval_fraction > 0 else 0
    shuffled = [documents[i] for i in order]
    return shuffled[held_out:], shuffled[:held_out]


def pack_documents(documents: list[Document], seq_len: int, pad_id: int) -> StreamRows:
    """Lay documents end to end and cut rows of seq_len + 1 tokens; the last row is padded (never a target).

    Piece ids are global and increasing: a new id starts at every document start and every row start.
    The tokens stay as compact as the documents hold them (`TokenStream`); a row becomes int64 when a batch
    takes it, so packing adds nothing per token for plain text (a single document is not even copied).
    """
    if not documents:
        raise DataError("cannot pack an empty list of documents")
    width = seq_len + 1
    for document in documents:
        if document.is_prompted and len(document.tokens) > width:
            raise DataError(
                f"{document.origin or 'a prompted document'}: prompt + completion is {len(document.tokens)} tokens "
                f"(with BOS/EOS), more than one row of data.seq_len + 1 = {width}; splitting it would train the "
                "completion without its prompt. Raise data.seq_len (and model.max_seq_len) or shorten the record"
            )
    streams = [doc.tokens if isinstance(doc.tokens, TokenStream) else TokenStream.of(doc.tokens) for doc in documents]
    offsets = np.zeros(len(documents) + 1, dtype=np.int64)
    np.cumsum([len(stream) for stream in streams], out=offsets[1:])
    targets = None
    if any(doc.is_prompted for doc in documents):
        targets = np.concatenate([np.ones(len(stream), dtype=bool) if doc.target_mask is None
                                  else np.asarray(doc.target_mask, dtype=bool) for doc, stream in zip(documents, streams)])
    return StreamRows(TokenStream.concatenate(streams), offsets, targets, width, pad_id)
