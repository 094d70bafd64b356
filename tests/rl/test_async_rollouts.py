"""Rollouts sampled one policy version ahead (rl.max_policy_lag): the logged lag is right, stale updates are
dropped as configured, a resume continues with the rollouts the run would have used, and a lag the config cannot
serve is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastlm.config.errors import ConfigError
from fastlm.engine.preflight import preflight_issues
from fastlm.logging.jsonl import read_metrics
from fastlm.run_config.loader import load_config
from fastlm.training.registry import build_trainer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
WARMUP = 2


def _config(tmp_path: Path, steps: int, *extra: str, name: str = "async"):
    return load_config(CONFIGS / "grpo.yaml", [
        f"run.output_dir={tmp_path}/{{name}}", f"run.name={name}", f"trainer.steps={steps}", "trainer.log_every=1",
        "trainer.eval_every=0", "trainer.checkpoint_every=0", "logging.progress=false", "logging.wandb.enabled=false",
        f"rl.warmup_steps={WARMUP}", "rl.prompts_per_rollout=4", "rl.eval_prompts=0", "model.num_layers=1",
        "data.micro_batch_size=8", *extra,
    ])


def _records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}


def test_one_rollout_ahead_trains_one_version_behind(tmp_path: Path) -> None:
    """updates_per_rollout 1, lag 1: the first RL rollout is sampled by the current weights (lag 0), every later
    one by the weights of one step before (lag 1); nothing is dropped and the run learns like the synchronous one."""
    summary = build_trainer(_config(tmp_path, WARMUP + 5, "rl.updates_per_rollout=1", "rl.max_policy_lag=1")).train()
    records = _records(summary.run_dir)
    lags = [records[step]["train/rollout/policy_lag"] for step in range(WARMUP + 1, WARMUP + 6)]
    print(f"policy lag per RL step: {lags}; rewards {summary.rewards}")
    assert lags == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert all(records[step]["train/rollout/stale_fraction"] == 0.0 for step in range(WARMUP + 1, WARMUP + 6))
    assert "train/rollout/policy_lag" not in records[WARMUP]  # warm-up steps train on demonstrations
    assert len(summary.rewards) == 5 and all(0.0 <= reward <= 1.0 for reward in summary.rewards)
    synchronous = _records(build_trainer(_config(tmp_path, WARMUP + 1, "rl.updates_per_rollout=1",
                                                 name="sync")).train().run_dir)
    assert "train/rollout/policy_lag" not in synchronous[WARMUP + 1]  # lag 0 logs what it always did
    # the first RL rollout is the same in both: sampled by the same weights from the same generators
    assert records[WARMUP + 1]["train/loss"] == synchronous[WARMUP + 1]["train/loss"]


def test_updates_past_the_lag_are_dropped(tmp_path: Path) -> None:
    """updates_per_rollout 2, lag 2: a rollout sampled ahead at the previous due point is 2 steps old at its first
    update and 3 at its second, which is dropped (the next rollout is served instead): some slots are dropped, and
    no trained update is more than 2 steps behind; with stale_samples keep they are trained."""
    summary = build_trainer(_config(tmp_path, WARMUP + 6, "rl.updates_per_rollout=2", "rl.max_policy_lag=2",
                                    "trainer.log_every=2")).train()
    records = _records(summary.run_dir)
    print({step: {k: v for k, v in r.items() if "rollout/" in k} for step, r in records.items()})
    assert all(r["train/rollout/policy_lag_max"] <= 2 for r in records.values() if "train/rollout/policy_lag_max" in r)
    assert sum(r.get("train/rollout/stale_fraction", 0.0) for r in records.values()) > 0
    kept = build_trainer(_config(tmp_path, WARMUP + 6, "rl.updates_per_rollout=2", "rl.max_policy_lag=2",
                                 "trainer.log_every=2", "rl.stale_samples=keep", name="keep")).train()
    kept_records = _records(kept.run_dir)
    assert max(r.get("train/rollout/policy_lag_max", 0) for r in kept_records.values()) == 3  # trained anyway
    assert all(r.get("train/rollout/stale_fraction", 0.0) == 0.0 for r in kept_records.values())


def test_a_resumed_run_trains_on_the_rollouts_it_would_have_used(tmp_path: Path) -> None:
    """A checkpoint holds the rollout sampled ahead: stopped after step 4 and resumed, the run logs the same
    losses and rewards as one that ran straight through."""
    lag = ["rl.updates_per_rollout=1", "rl.max_policy_lag=1"]
    straight = build_trainer(_config(tmp_path, WARMUP + 4, *lag, name="straight")).train()
    build_trainer(_config(tmp_path, WARMUP + 2, *lag, "trainer.checkpoint_every=1", name="resumed")).train()
    resumed = build_trainer(_config(tmp_path, WARMUP + 4, *lag, "trainer.checkpoint_every=1", name="resumed"))
    summary = resumed.train(resume=True)
    want, got = _records(straight.run_dir), _records(summary.run_dir)
    for step in (WARMUP + 3, WARMUP + 4):
        print(f"step {step}: loss {want[step]['train/loss']} vs {got[step]['train/loss']}, "
              f"reward {want[step]['train/reward']} vs {got[step]['train/reward']}")
        assert got[step]["train/loss"] == want[step]["train/loss"]
        assert got[step]["train/reward"] == want[step]["train/reward"]
        assert got[step]["train/rollout/policy_lag"] == want[step]["train/rollout/policy_lag"] == 1.0


def test_a_lag_below_the_updates_per_rollout_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        _config(tmp_path, WARMUP + 2, "rl.updates_per_rollout=2", "rl.max_policy_lag=1")
    (issue,) = caught.value.issues
    assert issue.path == "rl.max_policy_lag" and "rl.stale_samples: keep" in str(caught.value)
    _config(tmp_path, WARMUP + 2, "rl.updates_per_rollout=2", "rl.max_policy_lag=1", "rl.stale_samples=keep")


def test_more_than_one_process_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    issues = preflight_issues(_config(tmp_path, WARMUP + 2, "rl.updates_per_rollout=1", "rl.max_policy_lag=1"))
    assert any(issue.path == "rl.max_policy_lag" and "2 processes" in str(issue) for issue in issues), issues
