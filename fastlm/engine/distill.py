"""Distillation: the student trains on its usual batches plus the logits of a frozen teacher.

The teacher comes from a fastlm checkpoint (`model.head.losses.<name>.teacher_path`), with its own
architecture from the manifest and the same byte tokenizer. Its logits are computed per micro-batch
under the run's device and autocast, with no grad, and ride in `Batch.teacher_logits` into the head's
distillation child (forward or reverse KL with temperature, optionally next to cross-entropy).
The fixed eval batches get theirs once, at start.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from fastlm.run_config.schema import RunConfig
from fastlm.data.batch import Batch
from fastlm.engine.frozen import check_compatible, frozen_logits, load_frozen_model
from fastlm.engine.runtime import autocast
from fastlm.engine.trainer import Trainer


class DistillationTrainer(Trainer):
    """A Trainer whose batches carry the frozen teacher's logits."""

    def __init__(self, config: RunConfig, rank: int | None = None):
        super().__init__(config, rank)
        found = config.model.head.child_of_type("distillation")
        if found is None or found[1].teacher_path is None:
            raise ValueError("DistillationTrainer needs a distillation loss with teacher_path in model.head.losses")
        name, child = found
        field = f"model.head.losses.{name}.teacher_path"
        self.teacher = load_frozen_model(child.teacher_path, field, self.device)
        check_compatible(self.teacher, self.model, field, config.data.seq_len)

    @torch.no_grad()
    def prepare(self, batch: Batch) -> Batch:
        """The micro-batch on the run's device with `teacher_logits` (B, S, V) filled in; computed per
        micro-batch (train and eval), so only one micro-batch's teacher logits are alive at a time."""
        batch = super().prepare(batch)
        with autocast(self.device, self.amp_dtype):
            teacher_logits = frozen_logits(self.teacher, batch.input_ids, batch.document_ids)
        return replace(batch, teacher_logits=teacher_logits)
