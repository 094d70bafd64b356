"""Training rows read from prepared data sets on disk (`data.source: {type: memmap}` and `{type: blend}`).

Rows are the prepared token stream cut into windows of seq_len + 1 tokens, exactly as `pack_documents`
cuts documents laid end to end (the last row padded, never a target); a row is read from the memory
map when a batch asks for it, so memory holds one int64 row id per row, never the tokens. Rows are split
into train and eval by a seeded permutation (`data.eval_fraction`), and `BatchLoader` draws them in
seeded epochs with an exact-resume state. A blend draws each row from the source whose share is furthest
below its weight (deterministic, so its state is a count per source plus each source's loader state).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from fastlm.data.batch import Batch, batch_from_rows
from fastlm.data.config import BlendSource, DataConfig, MemmapSource
from fastlm.data.datasets import DataError
from fastlm.data.loader import BatchLoader
from fastlm.data.prepared import PreparedDataset, check_rows_fit, open_prepared
from fastlm.data.summary import check_batch_fits
from fastlm.data.tokenizer import Tokenizer


class MemmapRows:
    """The rows `row_ids` of a prepared data set's stream, `take`n from disk (see the module docstring)."""

    def __init__(self, dataset: PreparedDataset, seq_len: int, pad_id: int, row_ids: np.ndarray) -> None:
        self.dataset, self.width, self.pad_id, self.row_ids = dataset, seq_len + 1, pad_id, row_ids

    def __len__(self) -> int:
        return len(self.row_ids)

    def take(self, picks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, document ids, target flags, padding flags) of rows `picks`, each (len(picks), seq_len + 1)."""
        data, width = self.dataset, self.width
        tokens = np.full((len(picks), width), self.pad_id, dtype=np.int64)
        documents = np.full((len(picks), width), data.num_documents, dtype=np.int64)  # padding: its own id
        targets = np.zeros((len(picks), width), dtype=bool)
        padding = np.ones((len(picks), width), dtype=bool)
        for out, pick in enumerate(picks.tolist()):
            start = int(self.row_ids[pick]) * width
            end = min(start + width, data.num_tokens)
            count = end - start
            tokens[out, :count] = data.tokens[start:end]
            documents[out, :count] = np.searchsorted(data.offsets, np.arange(start, end), side="right") - 1
            targets[out, :count] = True if data.targets is None else data.targets[start:end].astype(bool)
            padding[out, :count] = False
        return torch.from_numpy(tokens), torch.from_numpy(documents), torch.from_numpy(targets), torch.from_numpy(padding)


def stream_rows(dataset: PreparedDataset, seq_len: int) -> int:
    return math.ceil(dataset.num_tokens / (seq_len + 1))


def memmap_rows(path: str, config: DataConfig, seed: int, tokenizer: Tokenizer) -> tuple[MemmapRows, MemmapRows | None]:
    """Train and eval rows of one prepared data set; eval holds ceil(rows * eval_fraction) rows (train keeps one)."""
    dataset = open_prepared(path, tokenizer)
    check_rows_fit(dataset, config.seq_len)
    total = stream_rows(dataset, config.seq_len)
    held_out = min(math.ceil(total * config.eval_fraction), total - 1) if config.eval_fraction > 0 else 0
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).numpy()
    train = MemmapRows(dataset, config.seq_len, tokenizer.pad_id, np.sort(order[held_out:]))
    evaluation = MemmapRows(dataset, config.seq_len, tokenizer.pad_id, np.sort(order[:held_out])) if held_out else None
    return train, evaluation


def _source_paths(config: DataConfig) -> list[tuple[str, float]]:
    source = config.source
    if isinstance(source, MemmapSource):
        return [(source.path, 1.0)]
    if isinstance(source, BlendSource):
        return [(entry.path, entry.weight) for entry in source.sources]
    raise DataError(f"data.source.type {source.type!r} is not a prepared data set")


def describe_prepared(config: DataConfig, seed: int, tokenizer: Tokenizer, rows_per_step: int, steps: int) -> str:
    """The dry run's data summary of a memmap or blend source, from the metadata (no token is read)."""
    paths = _source_paths(config)
    total = sum(weight for _, weight in paths)
    lines = []
    for index, (path, weight) in enumerate(paths):
        train, evaluation = memmap_rows(path, config, seed + index, tokenizer)
        data = train.dataset
        share = rows_per_step * steps * weight / total
        lines.append(f"data: {path}: {data.num_documents:,} documents, {data.num_tokens:,} tokens "
                     f"({data.metadata['tokenizer']['name']}); "
                     f"train {len(train):,} rows, eval {len(evaluation) if evaluation else 0:,} rows of {config.seq_len + 1} "
                     f"tokens; weight {weight / total:.2f} = {share / len(train):.2f} epochs over {steps:,} steps")
    return "\n".join(lines)


class BlendLoader:
    """Rows from several loaders by weight: each row comes from the source furthest below its share so far."""

    def __init__(self, loaders: list[BatchLoader], weights: list[float], batch_size: int) -> None:
        total = sum(weights)
        self.loaders, self.weights, self.batch_size = loaders, [w / total for w in weights], batch_size
        self.drawn = [0] * len(loaders)

    def _choose(self) -> int:
        count = sum(self.drawn) + 1
        deficits = [weight * count - drawn for weight, drawn in zip(self.weights, self.drawn)]
        choice = max(range(len(deficits)), key=deficits.__getitem__)
        self.drawn[choice] += 1
        return choice

    def next_batch(self) -> Batch:
        sources = [self._choose() for _ in range(self.batch_size)]
        rows = [self.loaders[s].rows.take(torch.tensor([self.loaders[s].next_index()])) for s in sources]
        return batch_from_rows(*(torch.cat(parts) for parts in zip(*rows)))

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": list(self.drawn), "sources": [loader.state_dict() for loader in self.loaders]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["sources"]) != len(self.loaders):
            raise ValueError(f"loader state is for a blend of {len(state['sources'])} sources, this data has "
                             f"{len(self.loaders)}; the data changed since the checkpoint")
        for loader, source_state in zip(self.loaders, state["sources"]):
            loader.load_state_dict(source_state)
        self.drawn = [int(count) for count in state["drawn"]]


def memmap_loaders(config: DataConfig, seed: int, tokenizer: Tokenizer) -> tuple[Any, Any]:
    """Train and eval loaders of a memmap or blend source (eval None when nothing is held out)."""
    paths = _source_paths(config)
    if isinstance(config.source, MemmapSource):
        train, evaluation = memmap_rows(paths[0][0], config, seed, tokenizer)
        check_batch_fits(train, evaluation, config.micro_batch_size)
        held_out = BatchLoader(evaluation, config.micro_batch_size, seed, shuffle=False) if evaluation else None
        return BatchLoader(train, config.micro_batch_size, seed), held_out
    splits = [memmap_rows(path, config, seed + index, tokenizer) for index, (path, _) in enumerate(paths)]
    weights = [weight for _, weight in paths]
    train = BlendLoader([BatchLoader(rows, 1, seed + index) for index, (rows, _) in enumerate(splits)], weights,
                        config.micro_batch_size)
    if any(held_out is None for _, held_out in splits):
        return train, None
    evaluation = BlendLoader([BatchLoader(held_out, 1, seed, shuffle=False) for _, held_out in splits], weights,
                             config.micro_batch_size)
    return train, evaluation
