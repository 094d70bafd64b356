"""The train and eval loaders of a run: the eval set held out of the train source (`data.eval_fraction`), or a
separate one (`data.eval_source`, read whole; the train source then is too)."""

from __future__ import annotations

from typing import Any

from fastlm.data.config import DataConfig
from fastlm.data.loader import BatchLoader, build_loaders
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
