"""Prepared data sets in training: weighted blends, exact resume (bitwise on CPU), a killed prepare."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from fastlm.data.config import DataConfig
from fastlm.data.datasets import DataError
from fastlm.data.memmap import memmap_loaders
from fastlm.data.prepare import PrepareConfig, prepare
from fastlm.data.tokenizer import ByteTokenizer
from fastlm.engine.step_scalars import StepResult
from fastlm.engine.trainer import Trainer
from fastlm.logging.jsonl import read_metrics
from fastlm.run_config.schema import RunConfig

ROOT = Path(__file__).resolve().parents[2]


def _prepared(tmp_path: Path, name: str, letter: str, count: int = 60) -> str:
    source = tmp_path / f"{name}.jsonl"
    source.write_text("".join(json.dumps({"text": f"{letter * (3 + i % 5)} {i}"}) + "\n" for i in range(count)))
    return str(prepare(PrepareConfig(input_path=str(source), output_path=str(tmp_path / name))).path)


def _blend(tmp_path: Path) -> dict:
    return {"type": "blend", "sources": [{"path": _prepared(tmp_path, "a", "a"), "weight": 3.0},
                                         {"path": _prepared(tmp_path, "b", "b"), "weight": 1.0}]}


def test_blend_draws_rows_by_weight_and_resumes_exactly(tmp_path: Path) -> None:
    config = DataConfig.model_validate({"source": _blend(tmp_path), "seq_len": 15, "micro_batch_size": 8})
    train, evaluation = memmap_loaders(config, seed=3, tokenizer=ByteTokenizer())
    first = [train.next_batch() for _ in range(5)]
    sources = ["a" if bool((b.input_ids[r] == ord("a")).any()) else "b" for b in first for r in range(8)]
    assert sources.count("a") == 30 and sources.count("b") == 10
    state = train.state_dict()
    expected = [train.next_batch().input_ids for _ in range(3)]
    again, _ = memmap_loaders(config, seed=3, tokenizer=ByteTokenizer())
    again.load_state_dict(json.loads(json.dumps(state)))  # checkpoints store it as JSON
    assert all(torch.equal(a, again.next_batch().input_ids) for a in expected)
    assert evaluation is not None and evaluation.next_batch().input_ids.shape == (8, 15)


class Preempted(Exception):
    pass


class PreemptedTrainer(Trainer):
    def train_step(self) -> StepResult:
        if self.step == 3:
            raise Preempted
        return super().train_step()


@pytest.mark.parametrize("kind", ["memmap", "blend"])
def test_resume_on_prepared_data_is_bitwise_identical(tmp_path: Path, kind: str) -> None:
    source = _blend(tmp_path) if kind == "blend" else {"type": "memmap", "path": _prepared(tmp_path, "m", "m")}

    def config(name: str) -> RunConfig:
        return RunConfig.model_validate({
            "run": {"name": name, "output_dir": str(tmp_path / "{name}")},
            "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "max_seq_len": 16, "dropout": 0.1},
            "data": {"source": source, "seq_len": 15, "micro_batch_size": 4},
            "trainer": {"steps": 6, "log_every": 1, "eval_every": 3, "checkpoint_every": 3},
            "logging": {"wandb": {"enabled": False}, "progress": False},
        })

    full = Trainer(config("full"))
    full.train()
    with pytest.raises(Preempted):
        PreemptedTrainer(config("resumed")).train()
    resumed = Trainer(config("resumed"))
    resumed.train(resume=True)
    losses = [{r["step"]: r["train/loss"] for r in read_metrics(t.run_dir / "metrics.jsonl")} for t in (full, resumed)]
    print("uninterrupted:", [losses[0][s] for s in (4, 5, 6)], "resumed:", [losses[1][s] for s in (4, 5, 6)])
    assert [losses[1][s] for s in (4, 5, 6)] == [losses[0][s] for s in (4, 5, 6)]
    assert all(torch.equal(a, b) for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True))


def test_a_killed_prepare_leaves_nothing_the_trainer_accepts(tmp_path: Path) -> None:
    source = tmp_path / "big.jsonl"
    source.write_text("".join(json.dumps({"text": f"document number {i} " * 20}) + "\n" for i in range(200_000)))
    (tmp_path / "prep.yaml").write_text(yaml.safe_dump({"input_path": "big.jsonl", "output_path": "out"}))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    process = subprocess.Popen([sys.executable, "-m", "fastlm", "prepare", str(tmp_path / "prep.yaml")], cwd=tmp_path,
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".out.tmp-*/tokens.bin")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, "prepare finished before it could be killed; make the input larger"
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (tmp_path / "out").exists()
    config = DataConfig.model_validate({"source": {"type": "memmap", "path": str(tmp_path / "out")}})
    with pytest.raises(DataError, match="prepared data set not found; run `fastlm prepare"):
        memmap_loaders(config, 0, ByteTokenizer())


def test_prepared_sources_name_their_files_for_the_data_fingerprint(tmp_path: Path) -> None:
    config = DataConfig.model_validate({"source": _blend(tmp_path)})
    names = [Path(file).relative_to(tmp_path).as_posix() for file in config.source.data_files()]
    assert names == ["a/metadata.json", "a/tokens.bin", "a/documents.npy", "b/metadata.json", "b/tokens.bin", "b/documents.npy"]
