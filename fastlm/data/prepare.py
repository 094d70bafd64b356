"""`fastlm prepare CONFIG`: tokenize local text / JSONL / Parquet / CSV files into a prepared data set.

Files are read by the Hugging Face `datasets` library (local files only) and tokenized by `Dataset.map`
with `num_proc` workers and its progress bar; every record becomes the same document the trainer would
build from a JSONL source (`record_document`: text, prompt/completion or chat messages). A text or JSON
Lines file with a record of 1 MiB or more is read and tokenized in this process one record at a time
instead (fastlm/data/long_records.py: a 50 MB line in about twice its size). Layout: fastlm/data/prepared.py.

The output is never lost or half-written: prepare holds a lock (`.<name>.lock` beside the output; a second
prepare into it is refused), writes into a staging directory `.<name>.tmp-<pid>` beside it, and swaps it
into place in one atomic exchange (`renameat2(RENAME_EXCHANGE)`; where the file system lacks it, the old set
is renamed aside first and put back by the next prepare if a kill lands between the two renames). An
existing set is replaced only with `overwrite: true`. SIGTERM/SIGINT remove the staging directory (the
tokenizer workers go with the pool; a worker whose parent dies is killed by the kernel), and every start
removes staging directories whose process is gone, so a `kill -9` leaves nothing behind for long.
"""

from __future__ import annotations

import array
import codecs
import ctypes
import errno
import glob
import hashlib
import json
import math
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field

from fastlm.data.config import ByteTokenizerConfig, RecordFields, TokenizerConfig
from fastlm.data.datasets import DataError, Document, record_document, string_field
from fastlm.data.long_records import RecordSpans, long_record_documents
from fastlm.data.prepared import (
    FORMAT,
    METADATA_FILE,
    OFFSETS_FILE,
    TARGETS_FILE,
    TOKENS_FILE,
    VERSION,
    file_sha256,
    token_dtype,
    token_sample,
    tokenizer_metadata,
)
from fastlm.data.token_stream import TokenStream
from fastlm.data.tokenizer import Tokenizer, build_tokenizer
from fastlm.system.disk_space import raise_if_disk_full
from fastlm.system.run_dir import RunDirLock, fsync_dir
from fastlm.system.signals import fault_point

FileFormat = Literal["text", "json", "parquet", "csv"]
MAX_NUM_PROC = 256
WRITE_TOKENS = 1 << 20  # ids of a long document widened and written at a time
_SUFFIXES: dict[str, FileFormat] = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json",
                                    ".parquet": "parquet", ".csv": "csv"}


class PrepareConfig(RecordFields):
    """What to tokenize, with which tokenizer, into which directory. Record fields as in a JSONL source;
    text files split into documents at blank lines (their `text_field` is `text`)."""

    tokenizer: TokenizerConfig = Field(default_factory=ByteTokenizerConfig)
    input_path: str = Field(description="A file, a directory (every file in it) or a glob pattern.")
    format: Literal["auto", "text", "json", "parquet", "csv"] = Field("auto", description="auto: by file suffix.")
    output_path: str = Field(description="The prepared data set's directory (written whole at the end).")
    num_proc: int = Field(1, ge=1, le=MAX_NUM_PROC, description="Tokenizer worker processes (at most the CPUs and "
                          "the record batches there are; a text or JSON Lines file with a record of 1 MiB or more is "
                          "tokenized in this process, one record at a time).")
    batch_size: int = Field(1000, ge=1, description="Records per tokenizer call.")
    overwrite: bool = Field(False, description="Replace an existing output_path.")


@dataclass(frozen=True)
class PrepareSummary:
    path: Path
    documents: int
    tokens: int
    seconds: float

    def describe(self) -> str:
        return (f"prepared {self.path}: {self.documents:,} documents, {self.tokens:,} tokens in {self.seconds:.1f} s "
                f"({self.tokens / max(self.seconds, 1e-9):,.0f} tokens/s)")


def input_files(config: PrepareConfig) -> list[Path]:
    path = Path(config.input_path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    elif path.is_file():
        files = [path]
    else:
        files = sorted(Path(p) for p in glob.glob(config.input_path) if Path(p).is_file())
    if not files:
        raise DataError(f"{config.input_path}: no input files (input_path takes a file, a directory or a glob)")
    return files


def file_format(config: PrepareConfig, path: Path) -> FileFormat:
    if config.format != "auto":
        return config.format
    if path.suffix.lower() not in _SUFFIXES:
        raise DataError(f"{path}: unknown suffix {path.suffix!r}; set format: to one of text, json, parquet, csv")
    return _SUFFIXES[path.suffix.lower()]


def check_utf8(path: Path, text: bool, chunk_bytes: int = 1 << 20) -> RecordSpans:
    """Stream the file once; invalid UTF-8 is a `DataError` naming the line (datasets would only say 'decode error').
    Returns its records' spans (`text`: blank-line separated; else lines), which say how to read it."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    spans = RecordSpans(text)
    lines_before = 0
    with path.open("rb") as handle:
        while chunk := handle.read(chunk_bytes):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as error:
                line = lines_before + chunk.count(b"\n", 0, max(error.start, 0)) + 1
                raise DataError(f"{path} line {line}: not valid UTF-8; re-encode the file as UTF-8") from None
            lines_before += chunk.count(b"\n")
            spans.feed(chunk)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise DataError(f"{path} line {lines_before + 1}: ends inside a UTF-8 character (truncated?)") from None
    return spans


class _Tokenize:
    """The `Dataset.map` function: a batch of records -> input_ids (+ targets); picklable for num_proc workers."""

    def __init__(self, fields: RecordFields, tokenizer: Tokenizer, path: Path, plain_text: bool) -> None:
        self.fields, self.tokenizer, self.path, self.plain_text = fields, tokenizer, path, plain_text
        self.dtype = token_dtype(tokenizer.vocab_size)

    def __call__(self, batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        names = list(batch)
        records = [{name: batch[name][row] for name in names} for row in range(len(indices))]
        if self.plain_text:  # one tokenizer call for the batch: the fast path for pretraining text
            texts = [string_field(record, self.fields.text_field, f"{self.path} row {index + 1}")
                     for record, index in zip(records, indices)]
            return {"input_ids": [_compact(ids, self.dtype) for ids in self.tokenizer.encode_batch(texts, bos=True, eos=True)]}
        documents = [record_document(record, self.fields, self.tokenizer, f"{self.path} row {index + 1}")
                     for record, index in zip(records, indices)]
        return {"input_ids": [_compact(d.tokens, self.dtype) for d in documents],
                "targets": [np.asarray(d.target_mask, dtype=np.bool_) for d in documents]}


def _compact(ids: list[int], dtype: np.dtype) -> np.ndarray:
    """A document's ids as an array of the set's dtype: Arrow takes it as it is (a list of Python ints became an
    int64 array first, 8 more bytes a token for a long document)."""
    return np.asarray(ids, dtype=dtype)


def _load(path: Path, fmt: FileFormat, cache: Path) -> Any:
    from datasets import load_dataset

    options: dict[str, Any] = {"sample_by": "paragraph"} if fmt == "text" else {}
    try:
        return load_dataset(fmt, data_files=[str(path)], split="train", cache_dir=str(cache), **options)
    except Exception as error:  # noqa: BLE001 - datasets wraps pyarrow's parse errors in several types
        cause = error.__cause__ or error
        raise DataError(f"{path}: could not be read as {fmt} ({type(cause).__name__}: {cause}); fix the file or set "
                        "format:") from None


class _Writer:
    """Appends documents to tokens.bin / targets.bin in the temporary directory; offsets kept in memory (8 B/doc)."""

    def __init__(self, directory: Path, dtype: np.dtype) -> None:
        self.directory, self.dtype = directory, dtype
        self.tokens = (directory / TOKENS_FILE).open("wb")
        self.targets = (directory / TARGETS_FILE).open("wb")
        self.lengths: list[np.ndarray] = []
        self.count = 0
        self.all_targets = True
        self.max_id = -1
        self.longest_prompted = 0  # tokens of the longest document with a non-target (prompt) token
        self.digest = hashlib.sha256()
        self.targets_digest = hashlib.sha256()

    def append(self, mapped: Any) -> None:
        """The tokenized `Dataset`'s documents."""
        table = mapped.data.table
        for index, chunk in enumerate(table.column("input_ids").chunks):
            ids = chunk.flatten().to_numpy()
            lengths = chunk.value_lengths().to_numpy().astype(np.int64)
            if "targets" in table.column_names:
                flags = table.column("targets").chunks[index].flatten().to_numpy(zero_copy_only=False).astype(np.uint8)
            else:
                flags = np.ones(len(ids), dtype=np.uint8)
            self._write(ids, flags)
            if not flags.all() and len(lengths):  # per document: does it hold a prompt (a 0 flag)?
                starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
                prompted = np.minimum.reduceat(flags, starts) == 0
                self.longest_prompted = max(self.longest_prompted, int(lengths[prompted].max(initial=0)))
            self.lengths.append(lengths)

    def append_documents(self, documents: Iterable[Document]) -> None:
        """Documents one at a time (`long_records`), each written WRITE_TOKENS ids at a time: a long one is never
        widened to the set's dtype whole."""
        lengths = array.array("q")
        for document in documents:
            stream = document.tokens if isinstance(document.tokens, TokenStream) else TokenStream.of(document.tokens)
            for start in range(0, len(stream), WRITE_TOKENS):
                end = min(start + WRITE_TOKENS, len(stream))
                flags = (np.ones(end - start, dtype=np.uint8) if document.target_mask is None
                         else np.asarray(document.target_mask[start:end], dtype=np.uint8))
                self._write(stream.window(start, end, self.dtype), flags)
            if document.is_prompted:
                self.longest_prompted = max(self.longest_prompted, len(stream))
            lengths.append(len(stream))
        self.lengths.append(np.frombuffer(lengths, dtype=np.int64))

    def _write(self, ids: np.ndarray, flags: np.ndarray) -> None:
        data = np.ascontiguousarray(ids, dtype=self.dtype)
        self.tokens.write(data)
        self.digest.update(data)
        flags = np.ascontiguousarray(flags)
        self.targets.write(flags)
        self.targets_digest.update(flags)
        self.all_targets &= bool(flags.all())
        self.max_id = max(self.max_id, int(ids.max()) if len(ids) else -1)
        self.count += len(ids)

    def finish(self, metadata: dict[str, Any]) -> dict[str, Any]:
        for handle in (self.tokens, self.targets):
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, dtype=np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        np.save(self.directory / OFFSETS_FILE, offsets)
        checksums = {"tokens_sha256": self.digest.hexdigest(),
                     "tokens_sample_sha256": token_sample(self.directory / TOKENS_FILE, self.dtype)[0],
                     "offsets_sha256": file_sha256(self.directory / OFFSETS_FILE)}
        if self.all_targets:
            (self.directory / TARGETS_FILE).unlink()
        else:
            checksums.update(targets_sha256=self.targets_digest.hexdigest(),
                             targets_sample_sha256=token_sample(self.directory / TARGETS_FILE, np.dtype(np.uint8))[0])
        metadata = {**metadata, "documents": len(lengths), "tokens": self.count, "max_token_id": self.max_id,
                    "has_targets": not self.all_targets, "dtype": self.dtype.name,
                    "longest_prompted": self.longest_prompted, **checksums}
        (self.directory / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n", encoding="utf-8")
        return metadata


def prepare(config: PrepareConfig) -> PrepareSummary:
    """Tokenize every input file into `config.output_path` (see the module docstring)."""
    started = time.perf_counter()
    tokenizer = build_tokenizer(config.tokenizer)
    files = input_files(config)
    formats = [file_format(config, path) for path in files]
    output = Path(config.output_path)
    lock = RunDirLock(output, output.with_name(f".{output.name}.lock"), label="prepared data set",
                      instead="choose another output_path")
    lock.acquire()
    try:
        with _stopped_by_signals():
            return _prepare_locked(config, tokenizer, files, formats, output, started)
    finally:
        lock.release(remove=True)  # a contender that opened it meanwhile sees another inode and retries


def _prepare_locked(config: PrepareConfig, tokenizer: Tokenizer, files: list[Path], formats: list[FileFormat],
                    output: Path, started: float) -> PrepareSummary:
    """What `prepare` does holding the output's lock: stage, then swap into place (module docstring)."""
    _recover(output)
    if os.path.lexists(output) and not config.overwrite:
        raise DataError(f"{output} already exists; choose another output_path or set overwrite: true")
    staging = _staging(output, os.getpid())
    staging.mkdir(parents=True)
    try:
        metadata = _write_set(config, tokenizer, files, formats, staging)
        fault_point("prepare_before_swap")
        _swap_into_place(staging, output)
    except BaseException as error:
        try:  # a full disk is one line: what, how much (about 3 bytes a byte: 2-byte ids + 1 flag), what is safe
            if isinstance(error, Exception):
                raise_if_disk_full(error, f"the prepared data set {output.name}", output.parent,
                                   3 * sum(path.stat().st_size for path in files), "nothing was moved into place")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(staging, ignore_errors=True)  # the old set, exchanged out of place (or nothing)
    return PrepareSummary(output, metadata["documents"], metadata["tokens"], time.perf_counter() - started)


def _write_set(config: PrepareConfig, tokenizer: Tokenizer, files: list[Path], formats: list[FileFormat],
               staging: Path) -> dict[str, Any]:
    """Every file tokenized into `staging`; the metadata written last."""
    writer = _Writer(staging, token_dtype(tokenizer.vocab_size))
    for path, fmt in zip(files, formats):
        if path.stat().st_size == 0:  # nothing to read (datasets cannot even infer its columns)
            continue
        if fmt != "parquet" and check_utf8(path, text=fmt == "text").holds_long_records():
            if fmt == "text":  # (what a JSONL record lacks is found as it is read)
                _check_columns(config, ["text"], path, fmt)
            writer.append_documents(long_record_documents(path, fmt == "text", config, tokenizer))
            continue
        dataset = _load(path, fmt, staging / "cache")
        _check_columns(config, dataset.column_names, path, fmt)
        with _workers_die_with_parent():
            mapped = dataset.map(_Tokenize(config, tokenizer, path, plain_text=_plain_text(config)), batched=True,
                                 with_indices=True, batch_size=config.batch_size,
                                 num_proc=worker_count(config.num_proc, len(dataset), config.batch_size),
                                 remove_columns=dataset.column_names, desc=f"tokenizing {path.name}")
        writer.append(mapped)
    if not writer.count:
        raise DataError(f"{config.input_path}: no documents (the input files are empty)")
    shutil.rmtree(staging / "cache", ignore_errors=True)
    sources = [{"path": str(path.resolve()), "format": fmt, "bytes": path.stat().st_size} for path, fmt in zip(files, formats)]
    return writer.finish({"format": FORMAT, "version": VERSION, "tokenizer": tokenizer_metadata(tokenizer),
                          "fields": config.model_dump(include=set(RecordFields.model_fields)), "sources": sources})


def worker_count(num_proc: int, records: int, batch_size: int) -> int | None:
    """Tokenizer processes: at most `num_proc`, the CPUs, and the record batches (None: tokenize in-process)."""
    count = min(num_proc, os.cpu_count() or 1, math.ceil(records / batch_size))
    return count if count > 1 else None


def _staging(output: Path, pid: int) -> Path:
    return output.with_name(f".{output.name}.tmp-{pid}")


def _aside(output: Path, pid: int) -> Path:
    return output.with_name(f".{output.name}.old-{pid}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _recover(output: Path) -> None:
    """Under the lock: put back an old set that a kill left aside (fallback swap), and remove the staging
    directories of prepares that are gone (killed with SIGKILL: nothing could clean up)."""
    pattern = re.compile(rf"\.{re.escape(output.name)}\.(tmp|old)-([0-9]+)")
    for path in sorted(output.parent.iterdir()) if output.parent.is_dir() else []:
        match = pattern.fullmatch(path.name)
        if match is None or _alive(int(match.group(2))) and int(match.group(2)) != os.getpid():
            continue
        if match.group(1) == "old" and not os.path.lexists(output):
            os.rename(path, output)
        else:
            shutil.rmtree(path, ignore_errors=True)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2); False where the system or file system lacks it."""
    function = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(second))


def _swap_into_place(staging: Path, output: Path) -> None:
    """Make `staging` the output; an old set ends up in `staging` (removed by the caller). At no point is
    there no set at `output` (but for the fallback's window, which `_recover` repairs)."""
    if not os.path.lexists(output):
        os.rename(staging, output)
    elif not _exchange(staging, output):
        aside = _aside(output, os.getpid())
        os.rename(output, aside)
        fault_point("prepare_between_renames")
        os.rename(staging, output)
        os.rename(aside, staging)
    fsync_dir(output.parent)


class PrepareStopped(Exception):
    """SIGTERM/SIGINT during prepare: the staging directory is removed and the output left as it was."""


@contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """SIGTERM and SIGINT raise `PrepareStopped` in this process (its cleanup runs); a forked worker that
    inherits the handler dies of the signal as it would have."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    owner = os.getpid()

    def stop(number: int, _frame: Any) -> None:
        if os.getpid() != owner:
            signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)
            return
        raise PrepareStopped(f"stopped by {signal.Signals(number).name}; the staging directory was removed and "
                             "the output left as it was")

    previous = {number: signal.signal(number, stop) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


_PR_SET_PDEATHSIG = 1
_forking_parent: int | None = None  # the prepare process while its tokenizer workers may be forked


def _bind_to_parent_after_fork() -> None:
    """In a child forked while `_workers_die_with_parent` is active: have the kernel SIGKILL it when its parent
    dies (a `kill -9` of prepare would otherwise leave workers tokenizing, or idle, for nobody). Set at the
    fork itself, so no window is left between the worker's start and its first batch. Linux only."""
    if _forking_parent is None:
        return
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != _forking_parent:  # the parent died before the call
            os._exit(1)


os.register_at_fork(after_in_child=_bind_to_parent_after_fork)


@contextmanager
def _workers_die_with_parent() -> Iterator[None]:
    """Children forked inside this block (the `Dataset.map` workers) die with this process."""
    global _forking_parent
    _forking_parent = os.getpid()
    try:
        yield
    finally:
        _forking_parent = None


def _plain_text(fields: RecordFields) -> bool:
    return fields.messages_field is None and fields.prompt_field is None


def _check_columns(fields: RecordFields, columns: list[str], path: Path, fmt: FileFormat) -> None:
    if fmt == "text":
        if not _plain_text(fields) or fields.text_field != "text":
            raise DataError(f"{path}: a text file holds plain text only; drop the record fields or convert it to JSONL")
        return
    if fields.messages_field is not None:
        wanted = [fields.messages_field]
    elif fields.prompt_field is not None and fields.completion_field is not None:
        wanted = [fields.prompt_field, fields.completion_field]
    else:
        wanted = [fields.text_field]
    missing = [name for name in wanted if name not in columns]
    if missing:
        raise DataError(f"{path}: no column {', '.join(map(repr, missing))} (columns: {columns}); set text_field, "
                        "prompt_field/completion_field or messages_field to the right names")
