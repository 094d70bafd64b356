"""torchrun end to end: `torchrun --nproc-per-node 2 -m fastlm train configs/tiny.yaml` (tiny overrides) trains,
and a rank that raises ends the job non-zero with its rank-prefixed traceback, leaving the last
complete checkpoint loadable."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

from dist_helpers import REPO, run_config, torchrun, train_run  # noqa: E402

from fastlm.engine.checkpoint import load_latest_checkpoint  # noqa: E402
from fastlm.logging.jsonl import read_metrics  # noqa: E402

TINY = [
    "trainer.steps=3", "trainer.log_every=1", "trainer.eval_every=3", "trainer.eval_batches=1", "trainer.checkpoint_every=0",
    "data.source.num_documents=60", "data.seq_len=16", "data.micro_batch_size=2", "model.hidden_size=32",
    "model.num_layers=1", "model.num_heads=2", "model.max_seq_len=16", "logging.wandb.enabled=false", "logging.progress=false",
]


def test_torchrun_fastlm_train_tiny(tmp_path: Path) -> None:
    done = torchrun(["-m", "fastlm", "train", str(REPO / "configs/tiny.yaml"), *TINY, f"run.output_dir={tmp_path}/tiny"])
    print(done.stderr[-2000:])
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("done: 3 steps") == 1  # the summary comes from rank 0 only
    assert load_latest_checkpoint(tmp_path / "tiny" / "checkpoints").step == 3
    (metrics,) = (tmp_path / "tiny").rglob("metrics.jsonl")
    records = [r for r in read_metrics(metrics) if "train/loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3]  # one record per step: only rank 0 logs


FAULTY = """
import sys

import torch

from fastlm.run_config.schema import RunConfig
from fastlm.engine.distributed import run_distributed
from fastlm.engine.trainer import Trainer


class FailsOnRankOne(Trainer):
    def train_step(self):
        if self.step == 2 and self.rank == 1:
            raise RuntimeError("injected failure on rank 1 before step 3")
        return super().train_step()


config = RunConfig.model_validate_json(open(sys.argv[1]).read())
sys.exit(run_distributed(lambda: FailsOnRankOne(config).train() and 0, config.distributed, torch.device("cpu")))
"""


def test_raising_rank_fails_the_job_and_keeps_the_checkpoint(tmp_path: Path) -> None:
    config = run_config(tmp_path, "faulty", trainer={"steps": 4, "checkpoint_every": 2}, distributed={"timeout_minutes": 1})
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "faulty.py").write_text(FAULTY)
    done = torchrun([str(tmp_path / "faulty.py"), str(tmp_path / "config.json")])
    print(done.stderr[-3000:])
    assert done.returncode != 0
    assert "[rank 1] RuntimeError: injected failure on rank 1 before step 3" in done.stderr
    assert load_latest_checkpoint(tmp_path / "faulty" / "checkpoints").step == 2
    resumed = train_run({**config, "data": {**config["data"], "micro_batch_size": 4}}, resume=True)
    assert len(resumed["losses"]) == 2  # steps 3 and 4 from the step-2 checkpoint
