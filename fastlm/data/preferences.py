"""Preference pairs for DPO: read from JSONL or generated from the addition task, packed as documents.

Each pair becomes two documents, chosen then rejected, each BOS + prompt (never a target) + answer +
EOS. A pair is never split across rows, and inside a row the ids of its two documents are consecutive,
so after `batch_from_rows` renumbers ids across the batch, sequence 2k is the chosen and 2k+1 the
rejected answer of pair k: the order `dpo_head_loss` reads. A row's padding joins its last document
as masked tokens (a separate padding id would count as an extra sequence).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from fastlm.data.batch import Batch
from fastlm.data.config import DataConfig, GeneratedPreferencesSource, PreferencesJsonlSource
from fastlm.data.datasets import (
    DataError,
    Document,
    PackedRows,
    _jsonl_field,
    _prompt_document,
    jsonl_records,
    split_documents,
)
from fastlm.data.tasks import AdditionTask
from fastlm.data.tokenizer import Tokenizer
from fastlm.losses.spec import LossTargets

PreferenceSource = PreferencesJsonlSource | GeneratedPreferencesSource


@dataclass(frozen=True)
class PreferencePair:
    """The chosen and rejected documents of one prompt; `where` names it in errors ("file line N")."""

    chosen: Document
    rejected: Document
    where: str

    def __len__(self) -> int:
        return len(self.chosen.tokens) + len(self.rejected.tokens)


def _pair(tokenizer: Tokenizer, prompt: str, chosen: str, rejected: str, where: str) -> PreferencePair:
    return PreferencePair(_prompt_document(tokenizer, prompt, chosen), _prompt_document(tokenizer, prompt, rejected), where)


def read_preference_jsonl(source: PreferencesJsonlSource, tokenizer: Tokenizer) -> list[PreferencePair]:
    """One pair per non-empty line; every problem names the file and line."""
    path = Path(source.path)
    pairs = []
    for line_number, record in jsonl_records(path):
        prompt, chosen, rejected = (
            _jsonl_field(record, name, path, line_number)
            for name in (source.prompt_field, source.chosen_field, source.rejected_field)
        )
        if chosen == rejected:
            raise DataError(f"{path} line {line_number}: '{source.chosen_field}' and '{source.rejected_field}' are equal")
        pairs.append(_pair(tokenizer, prompt, chosen, rejected, f"{path} line {line_number}"))
    if not pairs:
        raise DataError(f"{path}: no preference pairs (the file is empty)")
    return pairs


def generate_preference_pairs(source: GeneratedPreferencesSource, tokenizer: Tokenizer) -> list[PreferencePair]:
    """Addition problems: chosen is the right sum, rejected a plausible wrong one (off by 1..3)."""
    task, rng = AdditionTask(source.max_operand), random.Random(source.seed)
    pairs = []
    for index in range(source.num_pairs):
        problem = task.sample(rng)
        pairs.append(_pair(tokenizer, problem.prompt, problem.answer, task.wrong_answer(problem, rng), f"generated pair {index}"))
    return pairs


def load_preference_pairs(source: PreferenceSource, tokenizer: Tokenizer) -> list[PreferencePair]:
    if isinstance(source, PreferencesJsonlSource):
        return read_preference_jsonl(source, tokenizer)
    return generate_preference_pairs(source, tokenizer)


def pack_pairs(pairs: list[PreferencePair], seq_len: int, pad_id: int) -> PackedRows:
    """Rows of seq_len + 1 tokens holding whole pairs (chosen id, then rejected id), padded at the end."""
    if not pairs:
        raise DataError("cannot pack an empty list of preference pairs")
    width = seq_len + 1
    rows: list[tuple[list[int], list[int], list[bool], list[bool]]] = []
    tokens: list[int] = []
    ids: list[int] = []
    targets: list[bool] = []
    next_id = 0

    def close_row() -> None:
        padding = width - len(tokens)
        rows.append((tokens + [pad_id] * padding, ids + [ids[-1]] * padding, targets + [False] * padding,
                     [False] * len(tokens) + [True] * padding))

    for pair in pairs:
        if len(pair) > width:
            raise DataError(
                f"{pair.where}: the pair is {len(pair)} tokens (prompt twice, both answers, BOS/EOS each), "
                f"more than data.seq_len + 1 = {width}; raise data.seq_len or shorten the pair"
            )
        if len(tokens) + len(pair) > width:
            close_row()
            tokens, ids, targets = [], [], []
        for document in (pair.chosen, pair.rejected):
            tokens += document.tokens
            targets += document.target_mask
            ids += [next_id] * len(document.tokens)
            next_id += 1
    close_row()
    return PackedRows(
        tokens=torch.tensor([row[0] for row in rows], dtype=torch.int64),
        document_ids=torch.tensor([row[1] for row in rows], dtype=torch.int64),
        target_mask=torch.tensor([row[2] for row in rows], dtype=torch.bool),
        padding=torch.tensor([row[3] for row in rows], dtype=torch.bool),
    )


def preference_rows(config: DataConfig, seed: int, tokenizer: Tokenizer) -> tuple[PackedRows, PackedRows | None]:
    """Train and eval rows (eval None when nothing is held out); pairs, not documents, are split."""
    source = config.source
    if not isinstance(source, (PreferencesJsonlSource, GeneratedPreferencesSource)):
        raise DataError(f"data.source.type {source.type!r} holds no preference pairs")
    train, held_out = split_documents(load_preference_pairs(source, tokenizer), config.eval_fraction, seed)
    pad = tokenizer.pad_id
    return pack_pairs(train, config.seq_len, pad), pack_pairs(held_out, config.seq_len, pad) if held_out else None


@dataclass
class PreferenceBatch(Batch):
    """A Batch of packed pairs plus the frozen reference's summed label log-prob of each sequence.

    Its documents are counted in pairs: that is the step normaliser `dpo_head_loss` divides by.
    """

    reference_logps: torch.Tensor | None = None  # (sequences,), sequences in sorted document-id order

    def __post_init__(self) -> None:
        reference, self.reference_logps = self.reference_logps, None
        super().__post_init__()  # the per-token (B, S) checks, which a per-sequence tensor would fail
        self.reference_logps = reference
        sequences = self.num_sequences
        if sequences % 2:
            raise ValueError(f"PreferenceBatch has {sequences} sequences; pairs need an even count (chosen, rejected)")
        if reference is not None and tuple(reference.shape) != (sequences,):
            raise ValueError(
                f"PreferenceBatch.reference_logps has shape {tuple(reference.shape)}, expected ({sequences},): "
                "one summed log-prob per sequence"
            )

    @property
    def num_sequences(self) -> int:
        return int(torch.unique(self.document_ids).numel())

    @property
    def num_documents(self) -> int:
        """Pairs in this batch (DPO's normaliser counts pairs, not sequences)."""
        return self.num_sequences // 2

    def targets(self) -> LossTargets:
        return replace(super().targets(), reference_logps=self.reference_logps)
