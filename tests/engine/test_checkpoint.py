"""Checkpoints: bitwise resume, corruption detection with fallback, tied weights once, no pickle execution."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fastlm.engine.checkpoint import CheckpointError, load_latest_checkpoint
from fastlm.engine.step_scalars import StepResult
from fastlm.engine.trainer import Trainer
from fastlm.logging.jsonl import read_metrics
from fastlm.run_config.schema import RunConfig


class Preempted(Exception):
    """Stands in for the job being killed between two steps."""


class PreemptedTrainer(Trainer):
    """Dies when asked to run step `stop_before`, like a preempted job."""

    stop_before = 4

    def train_step(self) -> StepResult:
        if self.step + 1 == self.stop_before:
            raise Preempted
        return super().train_step()


def _losses(run_dir: Path) -> dict[int, float]:
    """Step -> logged loss; a later record of a step (after resume) wins."""
    return {r["step"]: r["train/loss"] for r in read_metrics(run_dir / "metrics.jsonl")}


def _resume_config(tiny_config: Callable[..., RunConfig], name: str) -> RunConfig:
    # dropout on, so the restored RNG state matters too
    return tiny_config(name, model={"dropout": 0.1}, trainer={"steps": 6, "checkpoint_every": 3, "keep_checkpoints": 3})


def test_resume_is_bitwise_identical(tiny_config: Callable[..., RunConfig]) -> None:
    full = Trainer(_resume_config(tiny_config, "full"))
    full.train()
    interrupted = PreemptedTrainer(_resume_config(tiny_config, "resumed"))
    with pytest.raises(Preempted):
        interrupted.train()
    assert sorted(p.name for p in interrupted.checkpoint_dir.glob("step-*")) == ["step-00000003"]
    resumed = Trainer(_resume_config(tiny_config, "resumed"))
    summary = resumed.train(resume=True)
    assert summary.steps == 6 and len(summary.losses) == 3

    expected, got = _losses(full.run_dir), _losses(resumed.run_dir)
    print("steps 4-6 uninterrupted:", [expected[s] for s in (4, 5, 6)], "resumed:", [got[s] for s in (4, 5, 6)])
    assert [got[s] for s in (4, 5, 6)] == [expected[s] for s in (4, 5, 6)]
    assert all(torch.equal(a, b) for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True))


def _trained(tiny_config: Callable[..., RunConfig], name: str, **sections: dict) -> Trainer:
    trainer = Trainer(tiny_config(name, **({"trainer": {"steps": 4, "checkpoint_every": 2}} | sections)))
    trainer.train()
    return trainer


def test_layout_pointer_and_pruning(tiny_config: Callable[..., RunConfig]) -> None:
    trainer = _trained(tiny_config, "layout", trainer={"steps": 6, "checkpoint_every": 2, "keep_checkpoints": 2})
    directory = trainer.checkpoint_dir
    assert sorted(p.name for p in directory.iterdir()) == ["latest", "step-00000004", "step-00000006"]
    assert (directory / "latest").read_text().strip() == "step-00000006"
    manifest = json.loads((directory / "step-00000006" / "manifest.json").read_text())
    assert manifest["step"] == 6 and manifest["config"]["run"]["name"] == "layout"
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((directory / "step-00000006" / name).read_bytes()).hexdigest() == digest


def test_corrupt_checkpoint_falls_back(tiny_config: Callable[..., RunConfig]) -> None:
    trainer = _trained(tiny_config, "corrupt")
    newest = trainer.checkpoint_dir / "step-00000004" / "model.safetensors"
    data = bytearray(newest.read_bytes())
    data[-1] ^= 0xFF
    newest.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match=r"step-00000004/model\.safetensors: sha256 mismatch"):
        loaded = load_latest_checkpoint(trainer.checkpoint_dir)
    assert loaded.step == 2

    (trainer.checkpoint_dir / "step-00000002" / "manifest.json").unlink()
    with pytest.warns(RuntimeWarning), pytest.raises(CheckpointError, match=r"no usable checkpoint.*manifest.json: missing"):
        load_latest_checkpoint(trainer.checkpoint_dir)


def test_resume_without_checkpoint_is_a_clear_error(tiny_config: Callable[..., RunConfig]) -> None:
    with pytest.raises(CheckpointError, match="no checkpoints found"):
        Trainer(tiny_config("fresh")).train(resume=True)


def test_pickled_code_is_never_executed(tiny_config: Callable[..., RunConfig], tmp_path: Path) -> None:
    trainer = _trained(tiny_config, "pickle", trainer={"steps": 1})
    step_dir = trainer.checkpoint_dir / "step-00000001"
    marker = tmp_path / "executed"
    torch.save({"payload": _Exploit(str(marker))}, step_dir / "trainer_state.pt")
    manifest = json.loads((step_dir / "manifest.json").read_text())  # an attacker can fix the checksum too
    manifest["files"]["trainer_state.pt"] = hashlib.sha256((step_dir / "trainer_state.pt").read_bytes()).hexdigest()
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(RuntimeWarning, match="could not read state"), pytest.raises(CheckpointError):
        load_latest_checkpoint(trainer.checkpoint_dir)
    assert not marker.exists()


class _Exploit:
    """Unpickling this would create a file; weights_only loading must refuse it."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_tied_weights_stored_once_and_restored(tiny_config: Callable[..., RunConfig]) -> None:
    trainer = _trained(tiny_config, "tied", model={"tie_embeddings": True}, trainer={"steps": 1})
    path = trainer.checkpoint_dir / "step-00000001" / "model.safetensors"
    with safe_open(str(path), framework="pt") as handle:
        keys = list(handle.keys())
    vocab_matrices = [k for k in keys if k.endswith("weight") and "tokens" in k]
    assert len(vocab_matrices) == 1 and not any("lm_head" in k for k in keys)
    fresh = Trainer(tiny_config("tied-load", model={"tie_embeddings": True}, run={"seed": 1}))
    load_latest_checkpoint(trainer.checkpoint_dir).load_model(fresh.model)
    assert fresh.model.output_weight.data_ptr() == fresh.model.embeddings.tokens.weight.data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.state_dict().values(), fresh.model.state_dict().values()))
