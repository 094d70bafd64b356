"""End to end with user code: a JSONL prompt set scored by a reward function from a module on disk; a reward
function that fails stops the run after a checkpoint of the last finished step, and --resume continues."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from fastlm.logging.jsonl import read_metrics
from fastlm.rl.rewards import RewardError
from fastlm.run_config.loader import load_config
from fastlm.training.registry import build_trainer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MODULE = '''
import os

def digits(prompts, completions, answer, **kwargs):
    if os.environ.get("FASTLM_TEST_REWARD_FAILS"):
        raise RuntimeError("the grader is down")
    return [1.0 if c == a else (0.1 if c.isdigit() else 0.0) for c, a in zip(completions, answer)]
'''


@pytest.fixture()
def user_setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "user_rewards.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    records = [{"text": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(5)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    yield tmp_path
    sys.modules.pop("user_rewards", None)


def _config(tmp_path: Path, *extra: str):
    return load_config(CONFIGS / "grpo.yaml", [
        f"run.output_dir={tmp_path}/run", "trainer.steps=4", "rl.warmup_steps=0", "rl.prompts_per_rollout=4",
        "trainer.log_every=1", "logging.progress=false", "logging.wandb.enabled=false", "rl.eval_prompts=0",
        f"rl.prompts={{type: jsonl, path: {tmp_path}/prompts.jsonl, prompt_field: text}}",
        "rl.rewards=[{function: 'user_rewards:digits', weight: 1.0}]", *extra,
    ])


def test_prompt_data_set_with_user_reward(user_setup: Path) -> None:
    summary = build_trainer(_config(user_setup)).train()
    records = read_metrics(summary.run_dir / "metrics.jsonl")
    assert len(records) == 4
    for record in records:
        assert {"train/rewards/digits/mean", "train/rewards/digits/std", "train/sampling/logp_diff/mean"} <= set(record)
        assert record["train/reward"] == pytest.approx(record["train/rewards/digits/mean"])


def test_failing_reward_checkpoints_then_resume_continues(user_setup: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = build_trainer(_config(user_setup, "rl.updates_per_rollout=1", "trainer.steps=3"))
    trainer.config.trainer.steps = 1
    trainer.train()  # step 1 finished (its own checkpoint at the end)
    monkeypatch.setenv("FASTLM_TEST_REWARD_FAILS", "1")
    config = _config(user_setup, "rl.updates_per_rollout=1", "trainer.steps=3")
    with pytest.raises(RewardError, match=r"reward function 'digits' \(user_rewards:digits\) raised RuntimeError: "
                                          r"the grader is down \(prompt index 0 .*checkpoint of step 1 saved"):
        build_trainer(config).train(resume=True)
    monkeypatch.delenv("FASTLM_TEST_REWARD_FAILS")
    summary = build_trainer(config).train(resume=True)
    assert summary.steps == 3
    assert [r["step"] for r in read_metrics(summary.run_dir / "metrics.jsonl")] == [1, 2, 3]
