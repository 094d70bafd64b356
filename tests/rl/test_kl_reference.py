"""The KL reference of a policy loss with beta > 0 is the policy as RL starts: after an SFT warm-up, the
warmed-up policy (not the random initial model), so the first RL step's `kl` is ~0 like `kl_old`; a
resume past the warm-up loads the reference saved then and continues exactly."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fastlm.engine.checkpoint import CheckpointError
from fastlm.logging.jsonl import read_metrics
from fastlm.rl.objective import REFERENCE_DIR
from fastlm.run_config.loader import load_config
from fastlm.training.registry import build_trainer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
WARMUP = 2


def _config(tmp_path: Path, steps: int, name: str = "kl"):
    return load_config(CONFIGS / "grpo.yaml", [
        f"run.output_dir={tmp_path}/{{name}}", f"run.name={name}", f"trainer.steps={steps}", "trainer.log_every=1",
        "trainer.eval_every=0", "trainer.checkpoint_every=0", "logging.progress=false", "logging.wandb.enabled=false",
        f"rl.warmup_steps={WARMUP}", "rl.prompts_per_rollout=4", "rl.eval_prompts=0", "rl.updates_per_rollout=1",
        "model.head.losses.grpo.beta=0.1", "model.num_layers=1", "data.micro_batch_size=8",
    ])


def test_reference_is_the_policy_at_the_end_of_the_warmup(tmp_path: Path) -> None:
    straight = build_trainer(_config(tmp_path, WARMUP + 2, "straight")).train()
    want = {r["step"]: r for r in read_metrics(straight.run_dir / "metrics.jsonl")}
    first = want[WARMUP + 1]
    print(f"first RL step: kl {first['train/grpo/kl']:.2e}, kl_old {first['train/grpo/kl_old']:.2e}")
    assert first["train/rl/warmup"] == 0.0 and want[WARMUP]["train/rl/warmup"] == 1.0
    assert abs(first["train/grpo/kl"]) < 1e-6 and abs(first["train/grpo/kl_old"]) < 1e-6
    assert want[WARMUP + 2]["train/grpo/kl"] > 1e-6  # the policy then moves away from it

    # a resume past the warm-up loads the reference saved then and continues exactly
    build_trainer(_config(tmp_path, WARMUP + 1, "resumed")).train()
    trainer = build_trainer(_config(tmp_path, WARMUP + 2, "resumed"))
    resumed = trainer.train(resume=True)
    assert trainer.objective.reference is not None and not any(p.requires_grad for p in trainer.objective.reference.parameters())
    got = {r["step"]: r for r in read_metrics(resumed.run_dir / "metrics.jsonl")}
    assert got[WARMUP + 2]["train/grpo/kl"] == pytest.approx(want[WARMUP + 2]["train/grpo/kl"], rel=1e-5, abs=1e-9)
    missing = build_trainer(_config(tmp_path, WARMUP + 3, "resumed"))
    shutil.rmtree(resumed.run_dir / REFERENCE_DIR)
    with pytest.raises(CheckpointError, match="KL reference saved at the end of the warm-up"):
        missing.train(resume=True)
