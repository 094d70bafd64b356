"""Distillation: the student trains on its usual batches plus the logits of a frozen teacher.

The teacher comes from a fastlm checkpoint (`model.head.losses.<name>.teacher_path`), with its own
architecture from the manifest and the same byte tokenizer. It runs per micro-batch (train and eval)
under the run's device and autocast, with no grad, into the head's distillation child (forward or
reverse KL with temperature, optionally next to cross-entropy): with the chunked head (the default)
its final hidden states and head weight ride in `Batch.teacher_head` and the head computes the
teacher's logits chunk by chunk; with `model.head.logits_memory_mib: 0` its full logits ride in
`Batch.teacher_logits`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from fastlm.data.batch import Batch
from fastlm.engine.frozen import check_compatible, frozen_head_input, frozen_logits, load_frozen_model
from fastlm.engine.trainer import Trainer
from fastlm.system.device import autocast

if TYPE_CHECKING:
    from fastlm.run_config.schema import RunConfig


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
        """The micro-batch on the run's device with the teacher's head input (chunked head) or its
        logits (B, S, V) filled in; computed per micro-batch, so only one micro-batch's are alive at a time."""
        batch = super().prepare(batch)
        with autocast(self.device, self.amp_dtype):
            if self.model.head.chunked:
                return replace(batch, teacher_head=frozen_head_input(self.teacher, batch.input_ids, batch.document_ids))
            return replace(batch, teacher_logits=frozen_logits(self.teacher, batch.input_ids, batch.document_ids))
