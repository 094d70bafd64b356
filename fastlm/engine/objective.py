"""What one training kind is, for the trainer's loop: an `Objective`.

An objective says what a step trains on (`batches`), which head computes its loss (`head`), what each
micro-batch gets just before its forward (`prepare`), what an eval step scores (`evaluate`) and what it adds
to a log record (`metrics`); its `loader` is the data position a checkpoint holds. The trainer
(fastlm/engine/trainer.py) runs the same loop for every objective; fastlm/training/registry.py picks one from
the config. `SupervisedObjective` is next-token training on packed text, preference pairs or a teacher's
targets: the frozen models its loss children declare (`LMHeadConfig.frozen_models`) fill each micro-batch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fastlm.data.batch import Batch
from fastlm.data.eval_source import build_run_loaders
from fastlm.data.loader import BatchLoader
from fastlm.data.summary import eval_repeat_note
from fastlm.data.tokenizer import Tokenizer
from fastlm.engine.distributed import Parallel, RankShardLoader, sum_over
from fastlm.engine.frozen import frozen_head_input, frozen_logits, load_frozen_model, reference_model
from fastlm.engine.step import global_normalizers
from fastlm.layers.lm_head import LMHead
from fastlm.losses.dpo import label_sequence_logps
from fastlm.losses.validation import deferred_value_checks
from fastlm.models.decoder import DecoderLM
from fastlm.system.device import autocast

if TYPE_CHECKING:
    from fastlm.run_config.schema import RunConfig


@dataclass
class TrainSummary:
    steps: int
    first_loss: float | None
    last_loss: float | None
    tokens_per_second: float
    skipped_steps: int
    eval_loss: float | None
    run_dir: Path
    losses: list[float] = field(default_factory=list)  # train/loss of every step this call ran
    stopped_by: str | None = None  # the signal that ended the run early (a checkpoint of `steps` was written)
    already_finished: bool = False  # a --resume of a run whose checkpoint is at trainer.steps: nothing ran


@dataclass
class TrainingParts:
    """What the trainer built before the objective, which builds its data and frozen models from them.
    `save` writes a checkpoint of the last finished step (an objective whose data source fails calls it)."""

    config: RunConfig
    tokenizer: Tokenizer
    model: DecoderLM
    device: torch.device
    parallel: Parallel
    rank: int | None
    amp_dtype: torch.dtype | None
    run_dir: Path
    save: Callable[[], Path]

    @property
    def verbose(self) -> bool:
        """Whether this process prints (the single process, or rank 0)."""
        return self.rank in (None, 0)


@dataclass
class StepTimes:
    """Wall seconds of the steps since the last log record (their data included), and how many."""

    seconds: float = 0.0
    steps: int = 0


class Objective:
    """The defaults every objective shares; see the module docstring."""

    late_reads = True  # log-only read points on CUDA may wait for their scalars one step later
    loader: Any  # `next_batch`, `state_dict`, `load_state_dict`: the data position a checkpoint holds

    def __init__(self, parts: TrainingParts):
        self.parts = parts
        self.config, self.model, self.device = parts.config, parts.model, parts.device

    def batches(self, step: int) -> list[Batch]:
        """What step `step + 1` trains on: `grad_accumulation` micro-batches."""
        return [self.loader.next_batch() for _ in range(self.config.trainer.grad_accumulation)]

    def head(self, step: int) -> LMHead:
        """The head step `step + 1`'s loss runs through: the model's own."""
        return self.model.head

    def prepare(self, batch: Batch) -> Batch:
        """One micro-batch, on the device (an asynchronous copy), just before its forward: the hook for per-batch
        extras (a teacher's logits) so they live for one micro-batch, not the whole step."""
        return batch.to(self.device)

    def lr_scale(self, step: int) -> float:
        """A factor on the schedule's learning rate at `step` (0-based)."""
        return 1.0

    def evaluate(self, step: int) -> dict[str, float]:
        """What an eval step logs (`trainer.eval_every`)."""
        return {}

    def metrics(self, step: int, times: StepTimes) -> dict[str, Any]:
        """What the objective adds to the log record after step `step`."""
        return {}

    def finish(self, summary: TrainSummary) -> TrainSummary:
        """The run's summary, completed by the objective."""
        return summary


def run_loaders(parts: TrainingParts) -> tuple[Any, BatchLoader | RankShardLoader | None]:
    """The train data source and the eval loader of the run's packed data.

    Data parallel: batches of micro_batch_size * dp from the same seeded order, each dp rank keeping its rows
    (rank-strided), so the global batch is the single-process batch of that size."""
    config, dp = parts.config, parts.parallel.dp_size
    data = config.data
    if dp > 1:
        data = data.model_copy(update={"micro_batch_size": data.micro_batch_size * dp})
    train, evaluation = build_run_loaders(data, config.run.seed, parts.tokenizer)
    trainer = config.trainer
    rows = getattr(evaluation, "rows", None)  # a prepared blend's eval loader draws rows by weight: no count
    note = eval_repeat_note(len(rows), trainer.eval_batches * data.micro_batch_size, data.micro_batch_size) if (
        rows is not None and trainer.eval_every) else None
    if note and parts.verbose:
        print(f"fastlm: {note}", file=sys.stderr, flush=True)
    if dp == 1:
        return train, evaluation
    rank = parts.parallel.dp_rank
    return RankShardLoader(train, rank, dp), None if evaluation is None else RankShardLoader(evaluation, rank, dp)


class SupervisedObjective(Objective):
    """Next-token losses on the run's data: plain LM, SFT, DPO (with its frozen reference's sequence log-probs)
    and distillation (with its frozen teacher's head input or logits), as the loss children declare."""

    def __init__(self, parts: TrainingParts):
        super().__init__(parts)
        config = parts.config
        self.loader, eval_loader = run_loaders(parts)
        self.eval_set = [eval_loader.next_batch() for _ in range(config.trainer.eval_batches)] if eval_loader else []
        self.teacher: DecoderLM | None = None
        self.reference: DecoderLM | None = None
        for child, need in config.model.head.frozen_models():
            name = f"{child}.{need.key}"
            if need.role == "teacher" and need.path is not None:
                self.teacher = load_frozen_model(need.path, name, self.device)  # checked by the start (preflight)
            elif need.role == "reference":
                self.reference = reference_model(self.model, need.path, name, self.device)

    @torch.no_grad()
    def prepare(self, batch: Batch) -> Batch:
        """The micro-batch on the device with what the frozen models add: the teacher's head input (chunked
        head) or logits (B, S, V), and the reference's summed log-prob of each sequence."""
        batch = super().prepare(batch)
        logits = None
        with autocast(self.device, self.parts.amp_dtype):
            if self.teacher is not None and self.model.head.chunked:
                batch = replace(batch, teacher_head=frozen_head_input(self.teacher, batch.input_ids, batch.document_ids))
            elif self.teacher is not None:
                batch = replace(batch, teacher_logits=frozen_logits(self.teacher, batch.input_ids, batch.document_ids))
            if self.reference is not None:
                logits = frozen_logits(self.reference, batch.input_ids, batch.document_ids)
        if logits is not None:  # the data's preference pairs
            batch = replace(batch, reference_logps=label_sequence_logps(
                logits.reshape(-1, logits.shape[-1]), batch.labels.reshape(-1), batch.document_ids.reshape(-1)))
        return batch

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float]:
        """The weighted total loss over the fixed held-out batches (one normaliser over all of them and all dp
        ranks), if there are any."""
        if not self.eval_set:
            return {}
        self.model.eval()
        normalizers = global_normalizers(self.eval_set, self.parts.parallel, self.device)
        total = torch.zeros((), device=self.device)
        with deferred_value_checks():
            for batch in self.eval_set:
                batch = self.prepare(batch)
                with autocast(self.device, self.parts.amp_dtype):
                    total += self.model(batch.input_ids, batch.targets(), normalizers, batch.document_ids).loss.float()
        return {"eval/loss": float(sum_over({"loss": total}, self.parts.parallel.dp_group)["loss"])}
