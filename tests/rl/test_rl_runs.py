"""End to end: the shipped GRPO/GSPO configs at tiny sizes learn (reward rises) and log every dashboard key."""

from __future__ import annotations

from pathlib import Path

import pytest
from wandb_reader import read_wandb_run

from fastlm.logging.jsonl import read_metrics
from fastlm.rl.objective import COMPLETIONS_KEY, RLSummary, window_means
from fastlm.run_config.loader import load_config
from fastlm.run_config.schema import RunConfig
from fastlm.training.registry import build_trainer, training_kind

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
ROLLOUT_KEYS = {
    "train/reward", "train/reward_std", "train/frac_reward_zero_std", "train/completions/mean_length",
    "train/completions/min_length", "train/completions/max_length", "train/completions/clipped_ratio",
    "train/advantage/std", "train/advantage/min", "train/advantage/max", "train/rl/rollouts",
    "train/sampling/logp_diff/mean", "train/sampling/logp_diff/max", "train/rewards/task/mean",
    "train/rewards/task/std", "train/timing/rollout_seconds", "train/timing/train_seconds",
}
POLICY_METRICS = {"new_logp", "entropy", "kl_old", "ratio", "advantage", "clip_ratio/low_mean", "clip_ratio/high_mean",
                  "clip_ratio/region_mean"}


def tiny_run(name: str, tmp_path: Path, *extra: str) -> RunConfig:
    """The shipped config, shortened: fewer warm-up and RL steps, small rollouts, wandb offline."""
    overrides = [
        f"run.output_dir={tmp_path}/{{name}}", "trainer.steps=110",
        "rl.eval_prompts=25", "trainer.log_every=1", "trainer.eval_every=30", "logging.progress=false",
        "logging.wandb.enabled=true", "logging.wandb.mode=offline", *extra,
    ]
    return load_config(CONFIGS / f"{name}.yaml", overrides)


def _check_logged(summary: RLSummary, policy: str, config: RunConfig) -> list[dict]:
    records = read_metrics(summary.run_dir / "metrics.jsonl")
    rl_records = [r for r in records if r["train/rl/warmup"] == 0.0]
    warmup = config.rl.warmup_steps if config.rl else 0
    assert len(rl_records) == config.trainer.steps - warmup
    expected = ROLLOUT_KEYS | {f"train/{policy}/{m}" for m in POLICY_METRICS} | {
        f"train/loss/{policy}", "train/loss/z_loss", "train/z_loss/lse", "train/loss", "train/lr", "train/grad_norm"}
    if policy == "gspo":
        expected.add("train/gspo/num_documents")
    for record in rl_records:
        assert expected <= set(record), sorted(expected - set(record))
    assert "train/loss/cross_entropy" in records[0] and "train/reward" not in records[0]  # warm-up step
    assert any("eval/reward" in r and "eval/accuracy" in r for r in rl_records)
    # the policy moved within a rollout: on the second update the ratio left 1 and clipping can act
    assert any(abs(r[f"train/{policy}/ratio"] - 1) > 1e-4 for r in rl_records)
    first_updates = [r for r in rl_records if (r["step"] - warmup) % config.rl.updates_per_rollout == 1]
    worst = max(abs(r[f"train/{policy}/ratio"] - 1) for r in first_updates)
    print(f"{policy}: max |ratio - 1| on first updates (old_logp recomputed by the training forward): {worst:.2e}")
    assert worst < 1e-5
    # fp32 on CPU, no top-p: the sampler's log-probs (KV cache) are the training forward's up to rounding
    gap = max(r["train/sampling/logp_diff/max"] for r in rl_records)
    print(f"{policy}: sampler vs training log-prob gap, max over the run {gap:.2e}")
    assert gap < 1e-4

    (run_file,) = (summary.run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history, _ = read_wandb_run(run_file)
    assert [row["step"] for row in history] == [r["step"] for r in records]
    for row, record in zip(history, records):  # a completions table comes back as its flattened file reference
        table_keys = {key for key in row if key.startswith(f"{COMPLETIONS_KEY}/")}
        assert set(row) - table_keys == set(record) - {"time", COMPLETIONS_KEY}
        assert bool(table_keys) == (COMPLETIONS_KEY in record)
    return records


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["grpo", "gspo"])
def test_config_learns_and_logs(policy: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tiny_run(policy, tmp_path)
    assert training_kind(config) == "online_rl"
    summary = build_trainer(config).train()
    assert isinstance(summary, RLSummary) and summary.steps == config.trainer.steps
    records = _check_logged(summary, policy, config)
    first, last = window_means(summary.rewards)
    evals = summary.eval_rewards
    print(f"{policy}: {len(summary.rewards)} rollouts, reward {first:.3f} -> {last:.3f}; eval {evals}")
    assert last > first + 0.05  # fixed seed: the RL phase raises the sampled reward
    assert evals[-1][1] > evals[0][1]
    assert "train/reward" in capsys.readouterr().err  # the end-of-run summary
    assert records[-1]["train/reward"] == pytest.approx(summary.rewards[-1])
