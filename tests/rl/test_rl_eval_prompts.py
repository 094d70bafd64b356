"""A prompt data set gets an eval: `rl.eval_prompts` holds prompts out of `rl.prompts` (a fraction or a count)
or names an eval JSONL; they are decoded greedily and scored by the run's reward functions (eval/reward)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fastlm.engine.trainer import Trainer
from fastlm.logging.jsonl import read_metrics
from fastlm.rl.prompts import encode_prompt
from fastlm.run_config.loader import load_config
from fastlm.training.registry import build_trainer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MODULE = '''
def digits(prompts, completions, answer, **kwargs):
    return [len(c) + (1.0 if c == a else 0.0) for c, a in zip(completions, answer)]
'''


@pytest.fixture()
def user_setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "eval_rewards.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    records = [{"text": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(5)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:3]))
    yield tmp_path
    sys.modules.pop("eval_rewards", None)


def _trainer(tmp_path: Path, eval_prompts: str) -> Trainer:
    return build_trainer(load_config(CONFIGS / "grpo.yaml", [
        f"run.output_dir={tmp_path}/run", "run.overwrite=true", "trainer.steps=2", "trainer.eval_every=2",
        "rl.warmup_steps=0", "rl.prompts_per_rollout=2", "rl.updates_per_rollout=1", "trainer.log_every=1",
        "logging.progress=false", "logging.wandb.enabled=false", "model.num_layers=1", f"rl.eval_prompts={eval_prompts}",
        f"rl.prompts={{type: jsonl, path: {tmp_path}/prompts.jsonl, prompt_field: text}}",
        "rl.rewards=[{function: 'eval_rewards:digits', weight: 1.0}]",
    ]))


def _greedy_reward(trainer: Trainer) -> float:
    """Greedy decoding by a plain argmax loop over full forwards, scored by the reward function by hand."""
    model, tokenizer = trainer.model, trainer.tokenizer
    (eos,) = trainer.objective.setup.options.stop_tokens
    scores = []
    with torch.no_grad():
        for record in trainer.objective.eval_records:
            ids = encode_prompt(tokenizer, record.text)
            answer: list[int] = []
            while len(answer) < trainer.objective.rl.max_new_tokens and (not answer or answer[-1] != eos):
                answer.append(int(model.logits(torch.tensor([ids + answer]))[0, -1].argmax()))
            text = tokenizer.decode(answer[:-1] if answer[-1] == eos else answer, skip_special=False)
            scores.append(len(text) + (1.0 if text == record.columns["answer"] else 0.0))
    return sum(scores) / len(scores)


def test_held_out_fraction_is_scored_greedily_by_the_training_rewards(user_setup: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    trainer = _trainer(user_setup, "0.2")
    train_texts = {record.text for record in trainer.objective.setup.prompts.records}
    eval_texts = [record.text for record in trainer.objective.eval_records]
    assert len(eval_texts) == 5 and len(train_texts) == 20 and not train_texts & set(eval_texts)
    assert "eval/reward on 5 prompts held out of" in capsys.readouterr().err
    summary = trainer.train()
    (last,) = [r for r in read_metrics(summary.run_dir / "metrics.jsonl") if "eval/reward" in r]
    want = _greedy_reward(trainer)
    print(f"eval/reward {last['eval/reward']:.3f}, by a plain argmax loop {want:.3f}")
    assert want > 0 and last["step"] == 2 and last["eval/reward"] == pytest.approx(want, abs=1e-12)
    assert last["eval/rewards/digits/mean"] == pytest.approx(want, abs=1e-12)
    assert summary.eval_rewards == [(2, last["eval/reward"])]


@pytest.mark.parametrize(("eval_prompts", "count"), [("{path: EVAL, prompt_field: text}", 3), ("64", 2), ("0", 0)])
def test_eval_jsonl_or_a_count(user_setup: Path, eval_prompts: str, count: int) -> None:
    trainer = _trainer(user_setup, eval_prompts.replace("EVAL", str(user_setup / "eval.jsonl")))
    assert len(trainer.objective.eval_records) == count  # a count holds out at most a tenth of the 25 prompts
    assert len(trainer.objective.setup.prompts.records) == 25 - (count if eval_prompts == "64" else 0)
