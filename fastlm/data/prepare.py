"""`fastlm prepare CONFIG`: tokenize local text / JSONL / Parquet / CSV files into a prepared data set.

Files are read by the Hugging Face `datasets` library (local files only) and tokenized by `Dataset.map`
with `num_proc` workers and its progress bar; every record becomes the same document the trainer would
build from a JSONL source (`record_document`: text, prompt/completion or chat messages). The result goes
to a temporary directory next to `output_path` and is renamed into place only when complete, so a killed
run leaves nothing the trainer would accept. Layout: fastlm/data/prepared.py.
"""

from __future__ import annotations

import codecs
import glob
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field

from fastlm.data.config import ByteTokenizerConfig, RecordFields, TokenizerConfig
from fastlm.data.datasets import DataError, record_document, string_field
from fastlm.data.prepared import (
    FORMAT,
    METADATA_FILE,
    OFFSETS_FILE,
    TARGETS_FILE,
    TOKENS_FILE,
    VERSION,
    token_dtype,
    tokenizer_metadata,
)
from fastlm.data.tokenizer import Tokenizer, build_tokenizer
from fastlm.system.disk_space import DiskFullError, raise_if_disk_full

FileFormat = Literal["text", "json", "parquet", "csv"]
_SUFFIXES: dict[str, FileFormat] = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json",
                                    ".parquet": "parquet", ".csv": "csv"}


class PrepareConfig(RecordFields):
    """What to tokenize, with which tokenizer, into which directory. Record fields as in a JSONL source;
    text files split into documents at blank lines (their `text_field` is `text`)."""

    tokenizer: TokenizerConfig = Field(default_factory=ByteTokenizerConfig)
    input_path: str = Field(description="A file, a directory (every file in it) or a glob pattern.")
    format: Literal["auto", "text", "json", "parquet", "csv"] = Field("auto", description="auto: by file suffix.")
    output_path: str = Field(description="The prepared data set's directory (written whole at the end).")
    num_proc: int = Field(1, ge=1, description="Tokenizer worker processes.")
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


def check_utf8(path: Path, chunk_bytes: int = 1 << 20) -> None:
    """Stream the file once; invalid UTF-8 is a `DataError` naming the line (datasets would only say 'decode error')."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    lines_before = 0
    with path.open("rb") as handle:
        while chunk := handle.read(chunk_bytes):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as error:
                line = lines_before + chunk.count(b"\n", 0, max(error.start, 0)) + 1
                raise DataError(f"{path} line {line}: not valid UTF-8; re-encode the file as UTF-8") from None
            lines_before += chunk.count(b"\n")
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise DataError(f"{path} line {lines_before + 1}: ends inside a UTF-8 character (truncated?)") from None


class _Tokenize:
    """The `Dataset.map` function: a batch of records -> input_ids (+ targets); picklable for num_proc workers."""

    def __init__(self, fields: RecordFields, tokenizer: Tokenizer, path: Path, plain_text: bool) -> None:
        self.fields, self.tokenizer, self.path, self.plain_text = fields, tokenizer, path, plain_text

    def __call__(self, batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        names = list(batch)
        records = [{name: batch[name][row] for name in names} for row in range(len(indices))]
        if self.plain_text:  # one tokenizer call for the batch: the fast path for pretraining text
            texts = [string_field(record, self.fields.text_field, f"{self.path} row {index + 1}")
                     for record, index in zip(records, indices)]
            return {"input_ids": self.tokenizer.encode_batch(texts, bos=True, eos=True)}
        documents = [record_document(record, self.fields, self.tokenizer, f"{self.path} row {index + 1}")
                     for record, index in zip(records, indices)]
        return {"input_ids": [d.tokens for d in documents], "targets": [d.target_mask for d in documents]}


def _load(path: Path, fmt: FileFormat, cache: Path) -> Any:
    from datasets import load_dataset

    options: dict[str, Any] = {"sample_by": "paragraph"} if fmt == "text" else {}
    try:
        return load_dataset(fmt, data_files=[str(path)], split="train", cache_dir=str(cache), **options)
    except Exception as error:  # datasets wraps pyarrow's parse errors in several types
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

    def append(self, mapped: Any) -> None:
        table = mapped.data.table
        for index, chunk in enumerate(table.column("input_ids").chunks):
            ids = chunk.flatten().to_numpy()
            lengths = chunk.value_lengths().to_numpy().astype(np.int64)
            if "targets" in table.column_names:
                flags = table.column("targets").chunks[index].flatten().to_numpy(zero_copy_only=False).astype(np.uint8)
            else:
                flags = np.ones(len(ids), dtype=np.uint8)
            self.tokens.write(ids.astype(self.dtype).tobytes())
            self.targets.write(flags.tobytes())
            self.all_targets &= bool(flags.all())
            self.max_id = max(self.max_id, int(ids.max()) if len(ids) else -1)
            self.lengths.append(lengths)
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
        if self.all_targets:
            (self.directory / TARGETS_FILE).unlink()
        metadata = {**metadata, "documents": len(lengths), "tokens": self.count, "max_token_id": self.max_id,
                    "has_targets": not self.all_targets, "dtype": self.dtype.name}
        (self.directory / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n", encoding="utf-8")
        return metadata


def prepare(config: PrepareConfig) -> PrepareSummary:
    """Tokenize every input file into `config.output_path` (see the module docstring)."""
    started = time.perf_counter()
    tokenizer = build_tokenizer(config.tokenizer)
    files = input_files(config)
    formats = [file_format(config, path) for path in files]
    output = Path(config.output_path)
    if output.exists() and not config.overwrite:
        raise DataError(f"{output} already exists; choose another output_path or set overwrite: true")
    staging = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        writer = _Writer(staging, token_dtype(tokenizer.vocab_size))
        for path, fmt in zip(files, formats):
            if path.stat().st_size == 0:  # nothing to read (datasets cannot even infer its columns)
                continue
            if fmt != "parquet":
                check_utf8(path)
            dataset = _load(path, fmt, staging / "cache")
            _check_columns(config, dataset.column_names, path, fmt)
            mapped = dataset.map(_Tokenize(config, tokenizer, path, plain_text=_plain_text(config)), batched=True,
                                 with_indices=True, batch_size=config.batch_size, num_proc=min(config.num_proc, max(len(dataset), 1)),
                                 remove_columns=dataset.column_names, desc=f"tokenizing {path.name}")
            writer.append(mapped)
        if not writer.count:
            raise DataError(f"{config.input_path}: no documents (the input files are empty)")
        shutil.rmtree(staging / "cache", ignore_errors=True)
        sources = [{"path": str(path.resolve()), "format": fmt, "bytes": path.stat().st_size} for path, fmt in zip(files, formats)]
        metadata = writer.finish({"format": FORMAT, "version": VERSION, "tokenizer": tokenizer_metadata(tokenizer),
                                  "fields": config.model_dump(include=set(RecordFields.model_fields)), "sources": sources})
        if output.exists():
            shutil.rmtree(output)
        os.replace(staging, output)
    except BaseException as error:
        try:  # a full disk is one line: what, how much (about 3 bytes a byte: 2-byte ids + 1 flag), what is safe
            if isinstance(error, Exception):
                raise_if_disk_full(error, f"the prepared data set {output.name}", output.parent,
                                   3 * sum(path.stat().st_size for path in files), "nothing was moved into place")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return PrepareSummary(output, metadata["documents"], metadata["tokens"], time.perf_counter() - started)


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


def load_prepare_config(path: str, overrides: list[str]) -> PrepareConfig:
    """The prepare YAML (with `base:` and overrides, paths relative to the file) as a validated config."""
    from pydantic import ValidationError

    from fastlm.config.errors import ConfigError
    from fastlm.run_config.loader import load_layers, to_issue

    layered = load_layers(path, overrides)
    try:
        return PrepareConfig.model_validate(layered.data)
    except ValidationError as error:
        raise ConfigError([to_issue(item, layered) for item in error.errors()]) from None


def prepare_command(path: str, overrides: list[str]) -> int:
    """`fastlm prepare CONFIG [key=value ...]`: exit 0 with a summary, 2 with the error for bad input."""
    from fastlm.config.errors import ConfigError
    from fastlm.data.tokenizer import TokenizerError

    try:
        summary = prepare(load_prepare_config(path, overrides))
    except ConfigError as error:
        print(error.render(), file=sys.stderr)
        return 2
    except (DataError, TokenizerError) as error:
        print(f"fastlm prepare: {error}", file=sys.stderr)
        return 2
    except DiskFullError as error:
        print(f"fastlm prepare: {error}", file=sys.stderr)
        return 1
    print(summary.describe())
    return 0
