"""Data parallel (DDP, FSDP2) and vocab-parallel training on 2 gloo ranks vs one process on the same global batch.

Mapping: dp ranks with micro_batch_size B see together the single-process batch of B * dp rows.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from dist_helpers import final_weights, max_rel_err, run_config, spawn, train_run  # noqa: E402

SECTIONS = {"trainer": {"grad_accumulation": 2, "eval_every": 3}}


def _compare(single: dict, ranks: dict[int, dict], tolerance: float) -> float:
    """Per-step losses and the eval loss of every rank against the single process; the largest relative gap."""
    gaps = [abs(a - b) / abs(b) for run in ranks.values() for a, b in zip(run["losses"], single["losses"], strict=True)]
    gaps += [abs(run["eval_loss"] - single["eval_loss"]) / abs(single["eval_loss"]) for run in ranks.values()]
    assert len(ranks) == 2 and max(gaps) < tolerance, (single, ranks)
    return max(gaps)


@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_data_parallel_matches_single_process(tmp_path: Path, data_parallel: str) -> None:
    single_config = run_config(tmp_path, "single", data={"micro_batch_size": 4}, **SECTIONS)
    parallel_config = run_config(tmp_path, "parallel", distributed={"data_parallel": data_parallel}, **SECTIONS)
    single = train_run(single_config)
    ranks = spawn(train_run, parallel_config)
    loss_gap = _compare(single, ranks, 1e-6)
    weight_gap = max_rel_err(final_weights(parallel_config), final_weights(single_config))
    print(f"{data_parallel} world 2 vs single: losses {single['losses']}, max rel loss gap {loss_gap:.2e}, "
          f"max rel weight gap {weight_gap:.2e}")
    assert weight_gap < 1e-5


@pytest.mark.parametrize("tie", [True, False])
def test_vocab_parallel_training_matches_single_process(tmp_path: Path, tie: bool) -> None:
    """tensor_parallel 2 (dp 1): both ranks train on the same batch, each holding half the vocab."""
    single_config = run_config(tmp_path, "single", model={"tie_embeddings": tie}, **SECTIONS)
    parallel_config = run_config(tmp_path, "tp", model={"tie_embeddings": tie}, distributed={"tensor_parallel": 2}, **SECTIONS)
    single = train_run(single_config)
    ranks = spawn(train_run, parallel_config)
    loss_gap = _compare(single, ranks, 1e-5)
    weight_gap = max_rel_err(final_weights(parallel_config), final_weights(single_config))
    print(f"tp 2 (tied={tie}) vs single: max rel loss gap {loss_gap:.2e}, max rel weight gap {weight_gap:.2e}")
    assert weight_gap < 1e-4
