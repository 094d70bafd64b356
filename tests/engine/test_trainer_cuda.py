"""On CUDA the trainer's step never makes the host wait for the GPU between read points, found with torch's
sync debug mode: the batch copies and the update (clipping, checks, the skip-capable fused AdamW, the
schedule) do not synchronise at all, nor does a whole step (the chunked LM head scales its gradients by
`grad_output` on the device instead of reading it)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (torch.cuda.set_sync_debug_mode)", allow_module_level=True)

from fastlm.data.batch import Batch
from fastlm.engine.objective import SupervisedObjective
from fastlm.engine.step_scalars import StepResult
from fastlm.engine.trainer import Trainer
from fastlm.run_config.schema import RunConfig

pytestmark = pytest.mark.gpu
MICRO_BATCHES = 2
SYNC_MESSAGE = "synchronizing CUDA operation"


@contextmanager
def sync_debug(mode: str) -> Iterator[None]:
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@contextmanager
def recorded_syncs() -> Iterator[list[str]]:
    """'file:line' of every synchronising call in the block (the sync debug mode's warnings)."""
    sites: list[str] = []
    with warnings.catch_warnings(record=True) as caught, sync_debug("warn"):
        warnings.simplefilter("always")
        yield sites
    sites += [f"{Path(w.filename).name}:{w.lineno}" for w in caught if SYNC_MESSAGE in str(w.message)]


class StrictObjective(SupervisedObjective):
    """Batch copies run with syncs raising an error."""

    def prepare(self, batch: Batch) -> Batch:
        with sync_debug("error"):
            return super().prepare(batch)


def strict_trainer(config: RunConfig) -> Trainer:
    """Batch copies, and updates of steps that are not read points, run with syncs raising an error."""
    trainer = Trainer(config, objective=StrictObjective)
    update = trainer.runner.optimizer_step

    def strict_update(result: StepResult, step: int) -> None:
        with sync_debug("default" if trainer.runner.read_due(step) else "error"):
            update(result, step)

    trainer.runner.optimizer_step = strict_update  # type: ignore[method-assign]
    return trainer


def _config(tmp_path: Path, compile: bool | str = "auto") -> RunConfig:
    return RunConfig.model_validate({
        "run": {"name": "sync", "output_dir": str(tmp_path / "{name}"), "seed": 0},
        "model": {"type": "llama", "hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                  "max_seq_len": 256},
        "data": {"source": {"type": "generated", "num_documents": 400}, "seq_len": 256, "micro_batch_size": 4},
        "trainer": {"steps": 8, "log_every": 4, "eval_every": 0, "checkpoint_every": 0, "device": "cuda",
                    "grad_accumulation": MICRO_BATCHES, "compile": compile},
        "logging": {"wandb": {"enabled": False}, "progress": False},
    })


def test_steps_between_read_points_do_not_sync(tmp_path: Path) -> None:
    trainer = strict_trainer(_config(tmp_path))  # trainer.compile auto: compiled blocks, the fused Triton loss
    trainer.train_step()  # step 1: compilation, optimizer state, pinned host buffers
    trainer.train_step()  # step 2: batch copies and update under "error"
    with recorded_syncs() as sites:
        trainer.train_step()  # step 3: the whole step recorded
    print(f"step 3 synchronised at: {sites or 'nowhere'}")
    assert not sites, sites
    trainer.train_step()  # step 4: a read point that only logs: its transfer starts behind the step
    assert trainer.runner.take_read_values() == [] and trainer.runner.in_flight is not None
    with recorded_syncs() as sites:
        trainer.train_step()  # step 5 is queued before the host waits for step 4's scalars
    read = trainer.runner.take_read_values()
    print(f"read after step 5 was queued: losses {[round(v.loss, 4) for v in read]}, "
          f"grad norms {[round(v.grad_norm, 3) for v in read]}; step 5 synchronised at: {sites}")
    assert [v.step for v in read] == [1, 2, 3, 4] and all(v.nonfinite is None for v in read)
    assert not sites, sites  # the wait for step 4's transfer is an event wait (not flagged); nothing else syncs
    assert read[-1].loss < read[0].loss + 1.0  # trained, not diverged


def test_bad_label_on_cuda_holds_updates_back_and_raises_at_the_read_point(tmp_path: Path) -> None:
    """A label out of the vocabulary (after the host check) on CUDA: the fused kernel stays memory-safe,
    the update is skipped on the device, and the (late) read point raises the loss's error naming the step."""

    class LateBadLabel(SupervisedObjective):
        def batches(self, step: int) -> list[Batch]:
            self.step = step
            return super().batches(step)

        def prepare(self, batch: Batch) -> Batch:
            batch = super().prepare(batch)
            if self.step == 1:
                labels = batch.labels.clone()
                labels[0, 0] = self.config.model.vocab_size
                batch = Batch(batch.input_ids, labels, batch.document_ids)
            return batch

    trainer = Trainer(_config(tmp_path, compile=False), objective=LateBadLabel)  # eager blocks: no second compilation
    trainer.train_step()
    after_first = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train_step()
    trainer.train_step()
    trainer.train_step()  # step 4, a log-only read point: read late (its transfer in flight)
    assert trainer.runner.in_flight is not None
    with pytest.raises(ValueError, match=r"step 2: targets.labels\[0\] = \d+ is outside the vocabulary"):
        trainer.train_step()  # step 5 is queued (and held back) before the read raises
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), after_first))
