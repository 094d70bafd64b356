"""DPO: the policy trains on packed preference pairs against a frozen reference.

The reference is a frozen copy of the initial policy (after `run.init_path`, before any step; a resume
rebuilds that same initial policy from the seed), or a fastlm checkpoint given as
`model.head.losses.<name>.reference_path`. Its summed label log-prob per sequence is computed per
micro-batch with no grad and rides in `PreferenceBatch.reference_logps` into the head's DPO loss,
which logs TRL's `rewards/{chosen,rejected,margins,accuracies}` per child.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

import torch

from fastlm.data.batch import Batch
from fastlm.data.preferences import PreferenceBatch
from fastlm.engine.frozen import frozen_logits, reference_model
from fastlm.engine.trainer import Trainer
from fastlm.losses.dpo import label_sequence_logps
from fastlm.system.device import autocast

if TYPE_CHECKING:
    from fastlm.run_config.schema import RunConfig


class DPOTrainer(Trainer):
    """A Trainer whose batches are preference pairs with the frozen reference's sequence log-probs."""

    def __init__(self, config: RunConfig, rank: int | None = None):
        super().__init__(config, rank)
        found = config.model.head.child_of_type("dpo")
        if found is None:
            raise ValueError("DPOTrainer needs a dpo loss in model.head.losses")
        name, child = found
        self.reference = reference_model(
            self.model, child.reference_path, f"model.head.losses.{name}.reference_path", self.device, config.data.seq_len
        )
        self.eval_set = [self.with_reference(batch) for batch in self.eval_set]

    @torch.no_grad()
    def with_reference(self, batch: Batch) -> PreferenceBatch:
        """The batch on the run's device with the reference's summed log-prob of each sequence."""
        batch = batch.to(self.device)
        with autocast(self.device, self.amp_dtype):
            logits = frozen_logits(self.reference, batch.input_ids, batch.document_ids)
        reference = label_sequence_logps(
            logits.reshape(-1, logits.shape[-1]), batch.labels.reshape(-1), batch.document_ids.reshape(-1)
        )
        return PreferenceBatch(**{item.name: getattr(batch, item.name) for item in fields(Batch)}, reference_logps=reference)

    def micro_batches(self) -> list[Batch]:
        return [self.with_reference(batch) for batch in super().micro_batches()]
