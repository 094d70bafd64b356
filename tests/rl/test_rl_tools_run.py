"""End to end: configs/grpo_tools.yaml, shortened to 20 rollouts after its warm-up (about 2 minutes on 2 CPU
cores: slow), executes tool calls in multi-turn episodes, and the tool-use rate and the reward rise; the
episodes' environment tokens are never targets."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastlm.logging.jsonl import read_metrics
from fastlm.rl.objective import window_means
from fastlm.run_config.loader import load_config
from fastlm.training.registry import build_trainer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.slow
def test_grpo_tools_calls_the_tool_and_reward_rises(tmp_path: Path) -> None:
    config = load_config(CONFIGS / "grpo_tools.yaml", [
        f"run.output_dir={tmp_path}/run", "trainer.steps=490", "rl.warmup_steps=450", "trainer.log_every=1",
        "rl.eval_prompts=0", "logging.progress=false", "logging.wandb.enabled=false",
    ])
    trainer = build_trainer(config)
    summary = trainer.train()
    batches = trainer.objective.loader.batches  # the last rollout: one label per policy token, none on tool replies
    targets = sum(int((batch.labels != -100).sum()) for batch in batches)
    replies = sum("### tool" in trainer.tokenizer.decode(row.tolist()) for batch in batches for row in batch.input_ids)
    records = [r for r in read_metrics(summary.run_dir / "metrics.jsonl") if r["train/rl/warmup"] == 0.0]
    calls = [r["train/env/tool_calls/mean"] for r in records]
    turns = [r["train/env/turns/max"] for r in records]
    print(f"tool calls per episode by step: {[round(c, 2) for c in calls]}")
    print(f"tool use rate by step: {[round(r['train/env/tool_use_rate'], 2) for r in records]}")
    episodes = config.rl.prompts_per_rollout * config.rl.group_size
    assert targets == round(records[-1]["train/completions/mean_length"] * episodes)
    print(f"reward by rollout: {[round(x, 3) for x in summary.rewards]}")
    assert sum(calls) > 0 and max(turns) >= 2 and replies > 0  # tools ran and the policy took another turn after them
    rates = [r["train/env/tool_use_rate"] for r in records][:: config.rl.updates_per_rollout]
    first_rate, last_rate = window_means(rates, 5)
    first, last = window_means(summary.rewards, 5)
    print(f"tool use rate {first_rate:.2f} -> {last_rate:.2f}, reward {first:.3f} -> {last:.3f} (first/last 5 rollouts)")
    assert last_rate > first_rate + 0.05, (first_rate, last_rate)
    assert last > first + 0.03, (first, last)
