"""A prepared data set on disk: the layout `fastlm prepare` writes and the trainer memory-maps.

    DIR/tokens.bin      every document's token ids end to end (numpy uint16 when the vocab fits, else uint32)
    DIR/documents.npy   int64 offsets: document d is tokens[offsets[d]:offsets[d + 1]]
    DIR/targets.bin     uint8 per token, 1 = a training target (only when some tokens are not: SFT, chat)
    DIR/metadata.json   format version, tokenizer name/fingerprint/vocab, counts, dtype, source files

Opening checks every file against the metadata (a truncated or swapped file is an error naming it) and
the tokenizer against the run's, and reads nothing but headers: tokens stay on disk until a row asks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fastlm.config.errors import ConfigIssue
from fastlm.data.datasets import DataError
from fastlm.data.tokenizer import Tokenizer, TokenizerError, build_tokenizer

if TYPE_CHECKING:
    from fastlm.run_config.schema import RunConfig

FORMAT = "fastlm-prepared"
VERSION = 1
TOKENS_FILE, OFFSETS_FILE, TARGETS_FILE, METADATA_FILE = "tokens.bin", "documents.npy", "targets.bin", "metadata.json"


def prepared_files(path: str | Path) -> list[str]:
    """The files of a prepared directory that exist, metadata first (targets.bin only when written)."""
    directory = Path(path)
    names = (METADATA_FILE, TOKENS_FILE, OFFSETS_FILE, TARGETS_FILE)
    return [str(directory / name) for name in names if (directory / name).is_file()]


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


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
    try:
        metadata = json.loads(meta_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise DataError(f"{meta_path}: not valid JSON ({error}); run `fastlm prepare` again") from None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT or metadata.get("version") != VERSION:
        raise DataError(f"{meta_path}: not a {FORMAT} v{VERSION} metadata file; run `fastlm prepare` again")
    return metadata


def check_tokenizer(metadata: dict[str, Any], tokenizer: Tokenizer, where: str) -> None:
    """The data set's ids must mean what the run's tokenizer means."""
    theirs = metadata["tokenizer"]
    if theirs["fingerprint"] != tokenizer.fingerprint:
        raise DataError(
            f"{where} was prepared with tokenizer {theirs['name']} (fingerprint {theirs['fingerprint']}, vocab "
            f"{theirs['vocab_size']}), but the run uses {tokenizer.name} (fingerprint {tokenizer.fingerprint}, vocab "
            f"{tokenizer.vocab_size}); prepare it again with the run's tokenizer, or set data.tokenizer to the one it used"
        )


def prepared_source_issues(config: "RunConfig") -> list[ConfigIssue]:
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
        top = int(dataset.metadata["max_token_id"])
        if top >= config.model.vocab_size:
            issues.append(ConfigIssue(field, f"holds token id {top}, beyond model.vocab_size {config.model.vocab_size}",
                                      path, hint="raise model.vocab_size to cover the tokenizer"))
    return issues


def _expect_size(path: Path, expected_bytes: int, what: str) -> None:
    if not path.is_file():
        raise DataError(f"{path}: missing ({what}); run `fastlm prepare` again")
    size = path.stat().st_size
    if size != expected_bytes:
        raise DataError(f"{path}: {size} bytes, but {path.parent / METADATA_FILE} says {expected_bytes} ({what}); "
                        "the file is truncated or from another data set: run `fastlm prepare` again")


def open_prepared(path: str | Path, tokenizer: Tokenizer) -> PreparedDataset:
    """Open a prepared directory for the run's tokenizer, checking every file against its metadata."""
    directory = Path(path)
    metadata = read_metadata(directory)
    check_tokenizer(metadata, tokenizer, str(directory))
    dtype = np.dtype(metadata["dtype"])
    count, documents = int(metadata["tokens"]), int(metadata["documents"])
    _expect_size(directory / TOKENS_FILE, count * dtype.itemsize, f"{count} tokens of {dtype}")
    tokens = np.memmap(directory / TOKENS_FILE, dtype=dtype, mode="r", shape=(count,))
    try:
        offsets = np.load(directory / OFFSETS_FILE, mmap_mode="r")
    except (OSError, ValueError) as error:
        raise DataError(f"{directory / OFFSETS_FILE}: unreadable ({error}); run `fastlm prepare` again") from None
    if offsets.shape != (documents + 1,) or int(offsets[0]) != 0 or int(offsets[-1]) != count:
        raise DataError(f"{directory / OFFSETS_FILE}: holds {offsets.shape[0]} offsets ending at {int(offsets[-1])}, "
                        f"but the metadata says {documents} documents and {count} tokens; run `fastlm prepare` again")
    targets = None
    if metadata["has_targets"]:
        _expect_size(directory / TARGETS_FILE, count, f"{count} target flags")
        targets = np.memmap(directory / TARGETS_FILE, dtype=np.uint8, mode="r", shape=(count,))
    return PreparedDataset(directory, metadata, tokens, offsets, targets)
