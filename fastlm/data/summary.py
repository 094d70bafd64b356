"""How much data a run has and whether one batch fits in it: the dry run's data summary and size checks.

A micro-batch larger than the data set would repeat rows inside one batch (the loader wraps epochs
mid-batch), so it is an error; an eval split smaller than one micro-batch still gives an eval/loss
(some rows counted twice), so it is a warning. Both name the numbers and the fields to change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastlm.config.errors import ConfigError, ConfigIssue
from fastlm.data.datasets import Rows

COUNT_ROWS = 4096  # rows counted at a time


@dataclass(frozen=True)
class SplitSize:
    rows: int  # packed rows of seq_len + 1 tokens
    tokens: int  # real tokens (padding excluded)
    labels: int  # tokens that are training targets
    documents: int | None  # documents (pairs count as two) where the tokenizer marks their start

    def describe(self) -> str:
        documents = "" if self.documents is None else f"{self.documents:,} documents, "
        return f"{documents}{self.tokens:,} tokens ({self.labels:,} targets) in {self.rows:,} rows"


def split_size(rows: Rows, bos_id: int | None) -> SplitSize:
    """Counted COUNT_ROWS rows at a time (a row is int64 only while it is counted); real tokens by the rows'
    padding flags, not by the pad id (which tokenizers such as Qwen's share with a real end-of-text token)."""
    documents = tokens = labels = 0
    for start in range(0, len(rows), COUNT_ROWS):
        ids, _, targets, padding = rows.take(torch.arange(start, min(start + COUNT_ROWS, len(rows))))
        documents += int((ids == bos_id).sum()) if bos_id is not None else 0
        tokens += int((~padding).sum())
        labels += int(targets.sum())
    return SplitSize(len(rows), tokens, labels, None if bos_id is None else documents)


@dataclass(frozen=True)
class DataSummary:
    train: SplitSize
    eval: SplitSize | None
    seq_len: int
    batch_rows: int  # rows of one micro-batch over all data-parallel ranks
    rows_per_step: int  # batch_rows * grad_accumulation
    steps: int

    @property
    def epochs(self) -> float:
        return self.rows_per_step * self.steps / self.train.rows

    def describe(self) -> str:
        lines = [
            f"data: train {self.train.describe()} of {self.seq_len + 1} tokens",
            f"data: eval {self.eval.describe()}" if self.eval is not None else "data: eval split: none",
            f"data: {self.rows_per_step:,} rows per step x {self.steps:,} steps = {self.epochs:.2f} epochs "
            f"of the train split",
        ]
        return "\n".join(lines)


def check_batch_fits(train: Rows, evaluation: Rows | None, batch_rows: int,
                     eval_rows: int | None = None) -> str | None:
    """ConfigError when one micro-batch (`batch_rows`, all dp ranks) is larger than the train split. With
    `eval_rows` (what one evaluation reads; 0 = no eval), the note when the eval split is smaller (see
    `eval_repeat_note`)."""
    if len(train) < batch_rows:
        raise ConfigError(ConfigIssue(
            "data.micro_batch_size", f"one micro-batch needs {batch_rows} rows (micro_batch_size x data-parallel "
            f"ranks), but the train split packs into only {len(train)} rows of data.seq_len + 1 tokens, so every "
            "batch would repeat rows", batch_rows,
            hint=f"lower data.micro_batch_size to at most {len(train)} (per rank), lower data.seq_len, or add data",
        ))
    if evaluation is None or not eval_rows:
        return None
    return eval_repeat_note(len(evaluation), eval_rows, batch_rows)


def eval_repeat_note(held_out_rows: int, eval_rows: int, batch_rows: int) -> str | None:
    """One line when an evaluation (`eval_rows` = trainer.eval_batches x `batch_rows`) reads more rows than the
    eval split holds, so eval/loss counts some twice (the trainer prints it once; validate reports it)."""
    if held_out_rows >= eval_rows:
        return None
    return (f"note: the eval split packs into {held_out_rows} rows and one evaluation reads {eval_rows} "
            f"(trainer.eval_batches {eval_rows // batch_rows} x {batch_rows} rows), so eval/loss counts some rows "
            "more than once; raise data.eval_fraction or lower trainer.eval_batches")


def summarize(train: Rows, evaluation: Rows | None, seq_len: int, batch_rows: int, grad_accumulation: int,
              steps: int, bos_id: int | None) -> DataSummary:
    return DataSummary(
        train=split_size(train, bos_id),
        eval=split_size(evaluation, bos_id) if evaluation is not None else None,
        seq_len=seq_len, batch_rows=batch_rows, rows_per_step=batch_rows * grad_accumulation, steps=steps,
    )

