"""A prepared data set on disk: the layout `fastlm prepare` writes and the trainer memory-maps.

    DIR/tokens.bin      every document's token ids end to end (numpy uint16 when the vocab fits, else uint32)
    DIR/documents.npy   int64 offsets: document d is tokens[offsets[d]:offsets[d + 1]]
    DIR/targets.bin     uint8 per token, 1 = a training target (only when some tokens are not: SFT, chat)
    DIR/metadata.json   format version, tokenizer name/fingerprint/vocab, counts, dtype, the largest id, the
                        longest SFT document, a sha256 of every other file (and a sampled sha256 of the
                        tokens and targets), source files

Nothing in the directory is trusted: opening checks the metadata against a schema (types, an allow-listed
dtype, counts, the largest id inside the tokenizer's vocab, a checksum for every file), every file against
the metadata (sizes, offsets int64, starting at 0, never decreasing, ending at the token count; no targets
file where the metadata says every token is a target), the tokenizer against the run's, the offsets' full
sha256 (8 bytes a document) and a sampled checksum of the tokens and the targets (64 blocks of 4 KiB each,
ids inside the vocab): a truncated, swapped or edited file is an error naming it. `fastlm prepare CONFIG
--verify` checks every file in full (sha256, every id, every target flag 0 or 1). Tokens otherwise stay on
disk until a row asks.

SFT records (a set with targets) follow the JSONL rule: a document with a prompt that does not fit one row
of seq_len + 1 tokens is refused (splitting it would train a completion without its prompt).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fastlm.config.errors import ConfigIssue
from fastlm.data.datasets import DataError
from fastlm.data.prepared_layout import METADATA_FILE, OFFSETS_FILE, TARGETS_FILE, TOKENS_FILE
from fastlm.data.tokenizer import Tokenizer, TokenizerError, build_tokenizer
from fastlm.system.json_text import JsonTextError, parse_json

if TYPE_CHECKING:
    from fastlm.run_config.schema import RunConfig

FORMAT = "fastlm-prepared"
VERSION = 2  # 2: every file checksummed (1 had the tokens' only)
TOKEN_DTYPES = ("uint16", "uint32")
SAMPLE_BLOCKS, SAMPLE_BYTES = 64, 4096
MAX_METADATA_BYTES = 16 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 22  # elements per chunk when scanning offsets or ids (bounded memory)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def _sample_spans(size: int, itemsize: int) -> list[tuple[int, int]]:
    """(offset, length) of the blocks the sampled checksum reads: the whole file when small, else
    SAMPLE_BLOCKS evenly spaced blocks (offsets aligned to whole ids)."""
    if size <= SAMPLE_BLOCKS * SAMPLE_BYTES:
        return [(0, size)]
    step = (size - SAMPLE_BYTES) // (SAMPLE_BLOCKS - 1)
    return [(index * step // itemsize * itemsize, SAMPLE_BYTES) for index in range(SAMPLE_BLOCKS)]


def token_sample(path: Path, dtype: np.dtype) -> tuple[str, int]:
    """(sha256 of the sampled blocks of a tokens or targets file, the largest value in them): cheap, a few
    hundred KiB."""
    digest, top = hashlib.sha256(), -1
    with path.open("rb") as handle:
        for offset, length in _sample_spans(path.stat().st_size, dtype.itemsize):
            handle.seek(offset)
            block = handle.read(length)
            digest.update(block)
            ids = np.frombuffer(block[: len(block) // dtype.itemsize * dtype.itemsize], dtype=dtype)
            top = max(top, int(ids.max()) if len(ids) else -1)
    return digest.hexdigest(), top


def file_sha256(path: Path) -> str:
    """sha256 of a whole file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def tokenizer_metadata(tokenizer: Tokenizer) -> dict[str, Any]:
    return {"name": tokenizer.name, "fingerprint": tokenizer.fingerprint, "vocab_size": tokenizer.vocab_size,
            "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id, "pad_id": tokenizer.pad_id}


@dataclass(frozen=True)
class PreparedDataset:
    """Memory-mapped views of one prepared directory (see the module docstring)."""

    path: Path
    metadata: dict[str, Any]
    tokens: np.ndarray  # memmap (tokens,)
    offsets: np.ndarray  # memmap (documents + 1,)
    targets: np.ndarray | None  # memmap (tokens,) or None: every token is a target
    sampled_max_id: int = -1  # the largest id in the checksum's sampled blocks

    @property
    def num_tokens(self) -> int:
        return int(self.metadata["tokens"])

    @property
    def num_documents(self) -> int:
        return int(self.metadata["documents"])


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata of a prepared directory; anything else (a half-written one, a wrong path) is a `DataError`."""
    directory = Path(path)
    meta_path = directory / METADATA_FILE
    if not directory.is_dir():
        raise DataError(f"{directory}: prepared data set not found; run `fastlm prepare CONFIG` to write it")
    if not meta_path.is_file():
        raise DataError(f"{meta_path}: missing, so {directory} is not a finished prepared data set (a killed "
                        "`fastlm prepare` leaves none); run `fastlm prepare` again")
    with meta_path.open("rb") as handle:
        raw = handle.read(MAX_METADATA_BYTES + 1)
    if len(raw) > MAX_METADATA_BYTES:
        raise DataError(f"{meta_path}: larger than {MAX_METADATA_BYTES >> 20} MiB, not a metadata file; run "
                        "`fastlm prepare` again")
    try:
        metadata = parse_json(raw)
    except JsonTextError as error:
        raise DataError(f"{meta_path}: not valid JSON ({error}); run `fastlm prepare` again") from None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT or metadata.get("version") != VERSION:
        older = isinstance(metadata, dict) and metadata.get("format") == FORMAT and metadata.get("version") == 1
        why = " (v1, written by an earlier fastlm, checksums the tokens only)" if older else ""
        raise DataError(f"{meta_path}: not a {FORMAT} v{VERSION} metadata file{why}; run `fastlm prepare` again")
    _check_schema(metadata, meta_path)
    return metadata


def _check_schema(metadata: dict[str, Any], meta_path: Path) -> None:
    """Every field the reader uses has its type and range (a damaged or edited file is one line naming the key)."""
    def count(value: Any, low: int) -> bool:
        return type(value) is int and value >= low

    tokenizer = metadata.get("tokenizer")
    vocab = tokenizer.get("vocab_size") if isinstance(tokenizer, dict) else None
    checks: list[tuple[str, bool, str]] = [
        ("dtype", metadata.get("dtype") in TOKEN_DTYPES, f"one of {list(TOKEN_DTYPES)}"),
        ("tokens", count(metadata.get("tokens"), 1), "an integer >= 1"),
        ("documents", count(metadata.get("documents"), 1) and count(metadata.get("tokens"), metadata["documents"]),
         "an integer from 1 to 'tokens'"),
        ("has_targets", type(metadata.get("has_targets")) is bool, "true or false"),
        ("tokenizer", isinstance(tokenizer, dict) and isinstance(tokenizer.get("name"), str)
         and isinstance(tokenizer.get("fingerprint"), str) and count(vocab, 1),
         "an object with a name, a fingerprint and a vocab_size"),
        ("max_token_id", count(metadata.get("max_token_id"), 0) and count(vocab, 1) and metadata["max_token_id"] < vocab,
         "an integer below the tokenizer's vocab_size"),
        ("longest_prompted", count(metadata.get("longest_prompted", 0), 0), "an integer >= 0"),
    ]
    checks += [(key, isinstance(metadata.get(key), str) and bool(_SHA256.fullmatch(metadata[key])), "a sha256 hex digest")
               for key in checksum_keys(metadata.get("has_targets") is True)]
    for key, ok, expected in checks:
        if not ok:
            raise DataError(f"{meta_path}: '{key}' must be {expected}, got {metadata.get(key)!r:.80}; the file is "
                            "damaged or was edited: run `fastlm prepare` again")


def checksum_keys(has_targets: bool) -> tuple[str, ...]:
    """The metadata's checksums: every file, and a sampled one of the large files `open_prepared` reads."""
    return ("tokens_sha256", "tokens_sample_sha256", "offsets_sha256",
            *(("targets_sha256", "targets_sample_sha256") if has_targets else ()))


def check_tokenizer(metadata: dict[str, Any], tokenizer: Tokenizer, where: str) -> None:
    """The data set's ids must mean what the run's tokenizer means."""
    theirs = metadata["tokenizer"]
    if theirs["fingerprint"] != tokenizer.fingerprint:
        raise DataError(
            f"{where} was prepared with tokenizer {theirs['name']} (fingerprint {theirs['fingerprint']}, vocab "
            f"{theirs['vocab_size']}), but the run uses {tokenizer.name} (fingerprint {tokenizer.fingerprint}, vocab "
            f"{tokenizer.vocab_size}); prepare it again with the run's tokenizer, or set data.tokenizer to the one it used"
        )


def prepared_source_issues(config: RunConfig) -> list[ConfigIssue]:
    """What opening the prepared data sets of a memmap or blend source would fail on, for `fastlm validate`:
    missing or damaged files, another tokenizer than the run's, token ids past the model's vocab."""
    from fastlm.data.config import MemmapSource

    source = config.data.source
    entries = [("data.source.path", source.path)] if isinstance(source, MemmapSource) else \
        [(f"data.source.sources.{index}.path", entry.path) for index, entry in enumerate(source.sources)]
    try:
        tokenizer = build_tokenizer(config.data.tokenizer, config.run.init_path)
    except TokenizerError:
        return []  # cross_check reports the tokenizer itself
    issues = []
    for field, path in entries:
        try:
            dataset = open_prepared(path, tokenizer)
        except DataError as error:
            issues.append(ConfigIssue(field, str(error), path))
            continue
        top = max(int(dataset.metadata["max_token_id"]), dataset.sampled_max_id)
        if top >= config.model.vocab_size:
            issues.append(ConfigIssue(field, f"holds token id {top}, beyond model.vocab_size {config.model.vocab_size}",
                                      path, hint="raise model.vocab_size to cover the tokenizer"))
        try:
            check_rows_fit(dataset, config.data.seq_len)
        except DataError as error:
            issues.append(ConfigIssue(field, str(error), path))
    return issues


def check_rows_fit(dataset: PreparedDataset, seq_len: int) -> None:
    """The JSONL source's rule for SFT records (fastlm/data/datasets.py `pack_documents`): a document with a
    prompt longer than one row is refused, not split."""
    longest, width = int(dataset.metadata.get("longest_prompted", 0)), seq_len + 1
    if longest > width:
        raise DataError(f"{dataset.path}: holds a prompt + completion document of {longest} tokens (with BOS/EOS), "
                        f"more than one row of data.seq_len + 1 = {width}; splitting it would train the completion "
                        "without its prompt. Raise data.seq_len (and model.max_seq_len) or shorten the record")


def _expect_size(path: Path, expected_bytes: int, what: str) -> None:
    if not path.is_file():
        raise DataError(f"{path}: missing ({what}); run `fastlm prepare` again")
    size = path.stat().st_size
    if size != expected_bytes:
        raise DataError(f"{path}: {size} bytes, but {path.parent / METADATA_FILE} says {expected_bytes} ({what}); "
                        "the file is truncated or from another data set: run `fastlm prepare` again")


def _check_offsets(offsets: np.ndarray, path: Path, documents: int, count: int) -> None:
    """int64, one more than the documents, from 0 to the token count, never decreasing (read in chunks)."""
    if offsets.dtype != np.int64 or offsets.shape != (documents + 1,) or int(offsets[0]) != 0 \
            or int(offsets[-1]) != count:
        raise DataError(f"{path}: holds {offsets.size} offsets ({offsets.dtype}, shape {offsets.shape}), but the metadata "
                        f"says {documents} documents and {count} tokens (int64 offsets from 0 to {count}); run "
                        "`fastlm prepare` again")
    for start in range(0, documents, _CHUNK):
        piece = np.asarray(offsets[start : start + _CHUNK + 1])
        if (np.diff(piece) < 0).any():
            where = start + int(np.argmax(np.diff(piece) < 0))
            raise DataError(f"{path}: offset {where + 1} is smaller than offset {where} (offsets must never "
                            "decrease); run `fastlm prepare` again")


def _open_files(directory: Path, metadata: dict[str, Any]) -> PreparedDataset:
    """Memory maps of the files, each checked against the (schema-checked) metadata."""
    dtype = np.dtype(metadata["dtype"])
    count, documents = metadata["tokens"], metadata["documents"]
    _expect_size(directory / TOKENS_FILE, count * dtype.itemsize, f"{count} tokens of {dtype}")
    tokens = np.memmap(directory / TOKENS_FILE, dtype=dtype, mode="r", shape=(count,))
    try:
        offsets = np.load(directory / OFFSETS_FILE, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as error:
        raise DataError(f"{directory / OFFSETS_FILE}: unreadable ({error}); run `fastlm prepare` again") from None
    _check_offsets(offsets, directory / OFFSETS_FILE, documents, count)
    if file_sha256(directory / OFFSETS_FILE) != metadata["offsets_sha256"]:
        raise DataError(f"{directory / OFFSETS_FILE}: its sha256 does not match {METADATA_FILE} (the document "
                        "boundaries were changed or damaged); run `fastlm prepare` again")
    targets = None
    if metadata["has_targets"]:
        _expect_size(directory / TARGETS_FILE, count, f"{count} target flags")
        targets = np.memmap(directory / TARGETS_FILE, dtype=np.uint8, mode="r", shape=(count,))
    elif os.path.lexists(directory / TARGETS_FILE):
        raise DataError(f"{directory / TARGETS_FILE}: present, but {METADATA_FILE} says every token is a target "
                        "(has_targets: false); the set was edited: run `fastlm prepare` again")
    return PreparedDataset(directory, metadata, tokens, offsets, targets)


def open_prepared(path: str | Path, tokenizer: Tokenizer) -> PreparedDataset:
    """Open a prepared directory for the run's tokenizer, checking every file against its metadata and the
    sampled checksum of the tokens (see the module docstring)."""
    directory = Path(path)
    metadata = read_metadata(directory)
    check_tokenizer(metadata, tokenizer, str(directory))
    dataset = _open_files(directory, metadata)
    digest, top = token_sample(directory / TOKENS_FILE, dataset.tokens.dtype)
    _check_sample(directory / TOKENS_FILE, digest, metadata["tokens_sample_sha256"], "the tokens")
    if dataset.targets is not None:
        flags, _ = token_sample(directory / TARGETS_FILE, np.dtype(np.uint8))
        _check_sample(directory / TARGETS_FILE, flags, metadata["targets_sample_sha256"], "the loss mask")
    if top >= metadata["tokenizer"]["vocab_size"]:
        raise DataError(f"{directory / TOKENS_FILE}: holds token id {top}, past the tokenizer's vocab "
                        f"({metadata['tokenizer']['vocab_size']}); the file is damaged: run `fastlm prepare` again")
    return PreparedDataset(directory, metadata, dataset.tokens, dataset.offsets, dataset.targets, top)


def _check_sample(path: Path, digest: str, expected: str, what: str) -> None:
    if digest != expected:
        raise DataError(f"{path}: its sampled checksum does not match {METADATA_FILE} ({what} were changed or "
                        "damaged); run `fastlm prepare` again (`fastlm prepare CONFIG --verify` checks a set in full)")


def verify_prepared(path: str | Path) -> str:
    """The full check of `fastlm prepare --verify`: every file, the tokens' sha256 and every id; a line."""
    directory = Path(path)
    metadata = read_metadata(directory)
    dataset = _open_files(directory, metadata)
    digest, top = hashlib.sha256(), -1
    for start in range(0, dataset.num_tokens, _CHUNK):
        ids = np.asarray(dataset.tokens[start : start + _CHUNK])
        digest.update(ids.tobytes())
        top = max(top, int(ids.max()))
    if digest.hexdigest() != metadata["tokens_sha256"]:
        raise DataError(f"{directory / TOKENS_FILE}: sha256 does not match {METADATA_FILE} (the tokens were changed "
                        "or damaged); run `fastlm prepare` again")
    if top != metadata["max_token_id"]:
        raise DataError(f"{directory / TOKENS_FILE}: its largest id is {top}, but {METADATA_FILE} says "
                        f"{metadata['max_token_id']}; run `fastlm prepare` again")
    if dataset.targets is not None:
        _verify_targets(directory / TARGETS_FILE, dataset.targets, metadata["targets_sha256"])
    checked = "every file's sha256, every id" + (" and target flag" if dataset.targets is not None else "")
    return (f"verified {directory}: {dataset.num_documents:,} documents, {dataset.num_tokens:,} tokens; sizes, "
            f"offsets, {checked} match")


def _verify_targets(path: Path, targets: np.ndarray, expected: str) -> None:
    """The whole loss mask: its sha256, and every flag 0 or 1."""
    digest = hashlib.sha256()
    for start in range(0, len(targets), _CHUNK):
        flags = np.asarray(targets[start : start + _CHUNK])
        digest.update(flags.tobytes())
        if (flags > 1).any():
            raise DataError(f"{path}: flag {start + int(np.argmax(flags > 1))} is not 0 or 1; run `fastlm prepare` again")
    if digest.hexdigest() != expected:
        raise DataError(f"{path}: sha256 does not match {METADATA_FILE} (the loss mask was changed or damaged); run "
                        "`fastlm prepare` again")
