"""An MoE model under FSDP2 on 2 gloo ranks equals one process on the same global batch (the router z-loss
is a token mean, so it splits exactly; the balance loss is per micro-batch by definition and is off here)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from dist_helpers import final_weights, max_rel_err, run_config, spawn, train_run

MODEL = {"type": "mixtral", "num_kv_heads": 1,
         "moe": {"num_experts": 4, "top_k": 2, "ffn_size": 16, "aux_loss_coef": 0.0, "z_loss_coef": 0.01}}
# AdamW's eps above the gradients' scale keeps its update linear in them: at 1e-8 an element whose gradient is
# near zero (its fp32 rounding differs with the reduction order) gets a +-lr-sized update either way.
SECTIONS = {"model": MODEL, "trainer": {"grad_accumulation": 2}, "optimizer": {"lr": 1e-2, "eps": 1e-3}}


@pytest.mark.slow
def test_fsdp_moe_matches_single_process(tmp_path: Path) -> None:
    single_config = run_config(tmp_path, "single", data={"micro_batch_size": 4}, **SECTIONS)
    parallel_config = run_config(tmp_path, "parallel", distributed={"data_parallel": "fsdp"}, **SECTIONS)
    single = train_run(single_config)
    ranks = spawn(train_run, parallel_config)
    gaps = [abs(a - b) / abs(b) for run in ranks.values() for a, b in zip(run["losses"], single["losses"], strict=True)]
    weight_gap = max_rel_err(final_weights(parallel_config), final_weights(single_config))
    print(f"fsdp world 2 vs single (MoE): losses {single['losses']}, max rel loss gap {max(gaps):.2e}, "
          f"max rel weight gap {weight_gap:.2e}")
    assert len(ranks) == 2 and max(gaps) < 1e-6 and weight_gap < 1e-5
