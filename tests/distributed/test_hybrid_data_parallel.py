"""The hybrid Qwen3.5 family (Gated DeltaNet + gated attention, packed generated documents) under FSDP2 on
2 gloo ranks equals one process on the same global batch, and a checkpointed run resumes exactly."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
from dist_helpers import final_weights, max_rel_err, run_config, spawn, train_run  # noqa: E402

MODEL = {"type": "qwen3_5", "hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
         "intermediate_size": 48, "layer_types": ["linear_attention", "full_attention"],
         "linear_attention": {"key_heads": 1, "value_heads": 2, "key_head_dim": 8, "value_head_dim": 8}}
SECTIONS = {"model": MODEL, "trainer": {"grad_accumulation": 2}}


@pytest.mark.slow  # about 90 s on 2 CPU cores (two spawned ranks), as the MoE FSDP test
def test_fsdp_hybrid_matches_single_process(tmp_path: Path) -> None:
    single_config = run_config(tmp_path, "single", data={"micro_batch_size": 4}, **SECTIONS)
    parallel_config = run_config(tmp_path, "parallel", distributed={"data_parallel": "fsdp"}, **SECTIONS)
    single = train_run(single_config)
    ranks = spawn(train_run, parallel_config)
    gaps = [abs(a - b) / abs(b) for run in ranks.values() for a, b in zip(run["losses"], single["losses"], strict=True)]
    weight_gap = max_rel_err(final_weights(parallel_config), final_weights(single_config))
    print(f"fsdp world 2 vs single (qwen3_5): losses {single['losses']}, max rel loss gap {max(gaps):.2e}, "
          f"max rel weight gap {weight_gap:.2e}")
    assert len(ranks) == 2 and max(gaps) < 1e-6 and weight_gap < 1e-5


def test_hybrid_checkpoint_resumes_exactly(tmp_path: Path) -> None:
    """A 2-step run resumed to 4 steps reproduces the last two losses of one 4-step run."""
    model = {"model": MODEL}
    straight = train_run(run_config(tmp_path, "straight", trainer={"steps": 4, "checkpoint_every": 2}, **model))
    train_run(run_config(tmp_path, "written", trainer={"steps": 2, "checkpoint_every": 2}, **model))
    shutil.copytree(tmp_path / "written", tmp_path / "resumed")
    resumed = train_run(run_config(tmp_path, "resumed", trainer={"steps": 4, "checkpoint_every": 2}, **model), True)
    print(f"qwen3_5 resumed losses {resumed['losses']} vs straight {straight['losses'][2:]}")
    assert resumed["losses"] == straight["losses"][2:]
