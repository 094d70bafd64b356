"""A checkpoint written by 2 DDP ranks (gathered full state on rank 0) resumes at world size 1 and 2.

Constant lr, so a 2-step run resumed to 4 steps must reproduce the last two losses of one 4-step run
(data position, optimizer moments and RNG all restored). Global batch 4 rows throughout.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from dist_helpers import run_config, spawn, train_run  # noqa: E402

LAYOUTS = {  # name -> (ranks, distributed section, micro_batch_size per rank)
    "world1": (1, {}, 4),
    "ddp2": (2, {"data_parallel": "ddp"}, 2),
    "fsdp2": (2, {"data_parallel": "fsdp"}, 2),
    "tp2": (2, {"tensor_parallel": 2}, 4),  # dp 1: both ranks see the whole batch
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """(run dir of a 2-step DDP run on 2 ranks, losses of one uninterrupted 4-step single-process run)."""
    root = tmp_path_factory.mktemp("resume")
    spawn(train_run, run_config(root, "written", trainer={"steps": 2}))
    straight = train_run(run_config(root, "straight", data={"micro_batch_size": 4}, trainer={"steps": 4}))
    return root / "written", straight["losses"]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_checkpoint_from_two_ranks_resumes(tmp_path: Path, runs: tuple[Path, list[float]], layout: str) -> None:
    written, straight = runs
    ranks, distributed, micro_batch = LAYOUTS[layout]
    shutil.copytree(written, tmp_path / "resumed")
    config = run_config(
        tmp_path, "resumed", trainer={"steps": 4}, distributed=distributed, data={"micro_batch_size": micro_batch}
    )
    resumed = {0: train_run(config, True)} if ranks == 1 else spawn(train_run, config, True)
    gaps = [abs(a - b) / b for run in resumed.values() for a, b in zip(run["losses"], straight[2:], strict=True)]
    print(f"resume at {layout} from a world-2 checkpoint: {[r['losses'] for r in resumed.values()]} vs "
          f"{straight[2:]}, max rel gap {max(gaps):.2e}")
    assert len(resumed) == ranks and max(gaps) < 1e-5
