"""The train and eval loaders of a run, by source type (prepared sets row by row, DPO pairs, document streams
packed): the eval set held out of the train source (`data.eval_fraction`), or a separate one
(`data.eval_source`, read whole; the train source then is too)."""

from __future__ import annotations

from typing import Any

from fastlm.data.batch import Batch
from fastlm.data.config import PREFERENCE_SOURCE_TYPES, PREPARED_SOURCE_TYPES, DataConfig
from fastlm.data.datasets import load_documents, pack_documents, split_documents
from fastlm.data.loader import BatchLoader
from fastlm.data.memmap import memmap_loaders
from fastlm.data.preferences import PreferenceBatch, preference_rows
from fastlm.data.summary import check_batch_fits
from fastlm.data.tokenizer import Tokenizer

EVAL_SOURCE_TYPES: frozenset[str] = frozenset({"generated", "text", "jsonl", "memmap"})  # document streams


def build_run_loaders(data: DataConfig, seed: int, tokenizer: Tokenizer) -> tuple[Any, BatchLoader | None]:
    """`build_loaders` of the train source, with eval batches from `data.eval_source` when it is set (its
    whole data, in a fixed seeded order: the trainer takes its fixed eval batches from the front)."""
    if data.eval_source is None:
        return build_loaders(data, seed, tokenizer)
    train, _ = build_loaders(data.model_copy(update={"eval_fraction": 0.0}), seed, tokenizer)
    evaluation, _ = build_loaders(data.model_copy(update={"source": data.eval_source, "eval_fraction": 0.0}), seed,
                                  tokenizer)
    return train, evaluation


def build_loaders(config: DataConfig, seed: int, tokenizer: Tokenizer) -> tuple[BatchLoader, BatchLoader | None]:
    """Train loader (shuffled) and eval loader (fixed order), or None for eval when nothing is held out."""
    if config.source.type in PREPARED_SOURCE_TYPES:  # prepared data sets on disk, read row by row
        return memmap_loaders(config, seed, tokenizer)
    batch_type = Batch
    if config.source.type in PREFERENCE_SOURCE_TYPES:  # DPO: whole pairs per row, not a document stream
        train_rows, eval_rows = preference_rows(config, seed, tokenizer)
        batch_type = PreferenceBatch
    else:
        train_docs, eval_docs = split_documents(load_documents(config.source, tokenizer), config.eval_fraction, seed)
        train_rows = pack_documents(train_docs, config.seq_len, tokenizer.pad_id)
        eval_rows = pack_documents(eval_docs, config.seq_len, tokenizer.pad_id) if eval_docs else None
    check_batch_fits(train_rows, eval_rows, config.micro_batch_size)
    train = BatchLoader(train_rows, config.micro_batch_size, seed, batch_type=batch_type)
    evaluation = (BatchLoader(eval_rows, config.micro_batch_size, seed, shuffle=False, batch_type=batch_type)
                  if eval_rows is not None else None)
    return train, evaluation
