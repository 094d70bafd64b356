"""`rl.old_logprobs: sampler` skips the rollout's old log-prob forward and trains on the sampler's own
log-probs. On CPU in float32 (no top-p) those are the training forward's up to rounding, so a run with them
follows the recomputing run step for step: the ratio stays 1 on each rollout's first update, and the losses
agree. A misplaced sampler log-prob (one position off in the packing) would move the ratio far off 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastlm.config.errors import ConfigError
from fastlm.logging.jsonl import read_metrics
from fastlm.run_config.loader import load_config
from fastlm.training.registry import build_trainer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
WARMUP, STEPS = 2, 6


def _config(tmp_path: Path, source: str, *extra: str):
    return load_config(CONFIGS / "grpo.yaml", [
        f"run.output_dir={tmp_path}/{{name}}", f"run.name={source}", f"trainer.steps={STEPS}", "trainer.log_every=1",
        "trainer.eval_every=0", "trainer.checkpoint_every=0", "logging.progress=false", "logging.wandb.enabled=false",
        f"rl.warmup_steps={WARMUP}", "rl.prompts_per_rollout=4", "rl.eval_prompts=0", "rl.updates_per_rollout=1",
        "model.num_layers=1", "data.micro_batch_size=8", f"rl.old_logprobs={source}", *extra,
    ])


def test_sampler_log_probs_train_like_recomputed_ones(tmp_path: Path) -> None:
    runs = {}
    for source in ("trainer", "sampler"):
        summary = build_trainer(_config(tmp_path, source)).train()
        runs[source] = [r for r in read_metrics(summary.run_dir / "metrics.jsonl") if r["train/rl/warmup"] == 0.0]
    assert len(runs["sampler"]) == STEPS - WARMUP
    for trained, sampled in zip(runs["trainer"], runs["sampler"]):
        assert "train/sampling/logp_diff/max" in trained and "train/sampling/logp_diff/max" not in sampled
        print(f"step {sampled['step']}: loss {sampled['train/loss']:.6f} vs {trained['train/loss']:.6f}, "
              f"ratio {sampled['train/grpo/ratio']:.8f} vs {trained['train/grpo/ratio']:.8f}")
        assert abs(sampled["train/grpo/ratio"] - 1.0) < 1e-5
        assert sampled["train/loss"] == pytest.approx(trained["train/loss"], rel=1e-4, abs=1e-6)
        assert sampled["train/reward"] == trained["train/reward"]  # the same completions: same weights, same draws


def test_sampler_log_probs_refuse_the_corrections_that_need_the_trainers(tmp_path: Path) -> None:
    for extra in ("rl.importance_sampling.mode=token_truncate", "rl.importance_sampling.mismatch_kl_coeff=0.1"):
        with pytest.raises(ConfigError, match="old_logprobs: sampler skips the trainer's forward"):
            _config(tmp_path, "sampler", extra)


def test_sampler_log_probs_refuse_a_truncated_sampler(tmp_path: Path) -> None:
    for extra in ("rl.top_p=0.9", "rl.top_k=20"):
        with pytest.raises(ConfigError, match="log-probs are of the truncated distribution"):
            _config(tmp_path, "sampler", extra)
        _config(tmp_path, "trainer", extra)  # the recomputed old log-probs take any sampler
