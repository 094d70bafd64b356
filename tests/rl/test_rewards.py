"""Rewards as user code, prompt data sets, the arithmetic-chain task, stop tokens, and the log-prob gap.

Reward functions live in a real module written to tmp_path and imported by its "module:function" path.
"""

from __future__ import annotations

import json
import math
import random
import sys
import textwrap

import pytest
import torch

from fastlm.config.errors import ConfigError
from fastlm.data.batch import batch_from_rows
from fastlm.data.datasets import DataError
from fastlm.data.tasks import ArithmeticChainTask, Problem, score
from fastlm.data.tokenizer import EOS, ByteTokenizer
from fastlm.rl.config import ImportanceSamplingConfig, JsonlPromptsConfig, RewardConfig, RLConfig
from fastlm.rl.consistency import gap_metrics, gap_statistics, importance_weights, tempered_transform
from fastlm.rl.prompts import JsonlPrompts, stop_token_ids
from fastlm.rl.rewards import RewardError, load_reward_functions, reward_metrics, score_completions, total_reward

REWARDS_MODULE = '''
def exact(prompts, completions, answer, **kwargs):
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]

def length_or_none(prompts, completions, completion_ids, **kwargs):
    return [None if not c else float(len(ids)) for c, ids in zip(completions, completion_ids)]

def nan_on_b(prompts, completions, **kwargs):
    return [float("nan") if c == "b" else 1.0 for c in completions]

def crashes_on_b(prompts, completions, **kwargs):
    return [1 / 0 if c == "b" else 1.0 for c in completions]

def short(prompts, completions, **kwargs):
    return [1.0]

def text(prompts, completions, **kwargs):
    return ["1.0" for _ in completions]
'''


@pytest.fixture()
def rewards_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(REWARDS_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def _arguments(completions: list[str]) -> dict[str, list]:
    return {"prompts": ["p"] * len(completions), "completions": completions,
            "completion_ids": [list(c.encode()) for c in completions], "stopped": [True] * len(completions),
            "answer": ["a"] * len(completions)}


def test_weighted_rewards_and_none(rewards_module: str) -> None:
    functions = load_reward_functions([RewardConfig(function=f"{rewards_module}:exact", weight=2.0),
                                       RewardConfig(function=f"{rewards_module}:length_or_none", weight=0.5)])
    per = score_completions(functions, _arguments(["a", "", "abc", "a"]), group_size=2)
    assert per[:, 0].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert math.isnan(per[1, 1]) and per[2, 1] == 3.0
    assert total_reward(per, functions).tolist() == [2.5, 0.0, 1.5, 2.5]  # None adds nothing
    metrics = reward_metrics(per, functions)
    assert metrics["rewards/exact/mean"] == 0.5 and metrics["rewards/length_or_none/none_count"] == 1.0


@pytest.mark.parametrize(("name", "message"), [
    ("crashes_on_b", r"'crashes_on_b' .* raised ZeroDivisionError: .*prompt index 1"),
    ("short", r"returned 1 values for 4 completions"),
    ("text", r"prompt index 0 \(completion 0\): returned str '1.0', expected a float or None"),
    ("nan_on_b", r"prompt index 1 \(completion 2\): returned nan"),
])
def test_bad_reward_functions_are_named(rewards_module: str, name: str, message: str) -> None:
    functions = load_reward_functions([RewardConfig(function=f"{rewards_module}:{name}")])
    with pytest.raises(RewardError, match=message):
        score_completions(functions, _arguments(["a", "a", "b", "a"]), group_size=2)


def test_nan_rewards_can_be_skipped(rewards_module: str) -> None:
    functions = load_reward_functions([RewardConfig(function=f"{rewards_module}:nan_on_b")])
    per = score_completions(functions, _arguments(["a", "b", "b", "a"]), group_size=2, nan_policy="skip")
    assert reward_metrics(per, functions)["rewards/nan_on_b/none_count"] == 2.0
    total = total_reward(per, functions)  # unscored: NaN (left out of the group, advantage 0)
    assert total[[0, 3]].tolist() == [1.0, 1.0] and total[[1, 2]].isnan().all()


def test_unimportable_reward_functions_are_config_errors(rewards_module: str) -> None:
    with pytest.raises(ConfigError, match=r"rl.rewards\[0\].function: cannot import module 'no_such_module'"):
        load_reward_functions([RewardConfig(function="no_such_module:f")])
    with pytest.raises(ConfigError, match=r"rl.rewards\[1\].function: module 'my_rewards' has no function 'missing'"):
        load_reward_functions([RewardConfig(function=f"{rewards_module}:exact"),
                               RewardConfig(function=f"{rewards_module}:missing")])


def test_jsonl_prompts_carry_columns_and_name_bad_lines(tmp_path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"question": "2+2=", "answer": "4"},
                                                       {"question": "3+3=", "answer": "6"}]) + "\n")
    config = JsonlPromptsConfig(path=str(path), prompt_field="question")
    source = JsonlPrompts(config, ByteTokenizer(), 100)
    drawn = {source.sample(random.Random(seed)).text for seed in range(20)}
    assert drawn == {"2+2=", "3+3="} and source.records[0].columns == {"answer": "4"}
    with pytest.raises(DataError, match=r"prompts.jsonl line 1: the prompt has 5 tokens, more than .* = 4"):
        JsonlPrompts(config, ByteTokenizer(), 4)
    path.write_text('{"question": "2+2="}\n{"prompt": "x"}\n')
    with pytest.raises(
        DataError, match=r"line 2: field 'question' \(rl.prompts.prompt_field\) must be a non-empty string or a list of chat"
    ):
        JsonlPrompts(config, ByteTokenizer(), 100)


def test_prompt_data_set_needs_reward_functions() -> None:
    with pytest.raises(ValueError, match="rl.prompts .* needs rl.rewards"):
        RLConfig(prompts={"path": "p.jsonl"})


def test_arithmetic_chain_answers_are_long_and_checked_by_number() -> None:
    task = ArithmeticChainTask(steps=3)
    rng = random.Random(0)
    problems = [task.sample(rng) for _ in range(50)]
    lengths = [len(ByteTokenizer().encode(p.answer)) for p in problems]
    print(f"answer lengths (byte tokens): min {min(lengths)}, mean {sum(lengths) / len(lengths):.1f}")
    assert min(lengths) >= 20
    for problem in problems:
        final = problem.answer.rsplit(" ", 1)[1]
        assert score(task, problem, problem.answer, True, 0.1) == 1.0
        assert score(task, problem, f"I think Answer: {final}", True, 0.1) == 1.0  # the steps are free-form
        assert score(task, problem, task.wrong_answer(problem, rng), True, 0.1) == 0.1
        assert score(task, problem, problem.answer, False, 0.1) == 0.0  # no stop token
        assert score(task, problem, "no idea", True, 0.1) == 0.0
    assert task.is_correct(Problem("", "1+1=2 Answer: 2"), "Answer: 2") and not task.is_correct(
        Problem("", "1+1=2 Answer: 2"), "Answer: 22 ")


def test_stop_tokens_resolve_or_fail_with_the_field() -> None:
    tokenizer = ByteTokenizer()
    assert stop_token_ids(RLConfig(), tokenizer) == (EOS,)
    assert stop_token_ids(RLConfig(stop_tokens=["<eos>", "\n"]), tokenizer) == (EOS, 10)
    with pytest.raises(ConfigError, match=r"rl.stop_tokens\[0\]: is not a single token"):
        stop_token_ids(RLConfig(stop_tokens=["<|im_end|>"]), tokenizer)

    class NoEos(ByteTokenizer):
        eos_id = None

    with pytest.raises(ConfigError, match="has no EOS token"):
        stop_token_ids(RLConfig(), NoEos())


def test_tempered_transform_equals_dividing_the_transformed_logits() -> None:
    from fastlm.losses.spec import transform_logits

    z = torch.randn(4, 30, dtype=torch.float64) * 5
    for scale, softcap, temperature in [(1.0, None, 0.7), (1.7, 2.5, 1.3), (0.5, 30.0, 0.6)]:
        tempered = transform_logits(z, *tempered_transform(scale, softcap, temperature))
        want = transform_logits(z, scale, softcap) / temperature
        assert torch.allclose(tempered, want, rtol=1e-12, atol=1e-12)


def _two_document_batch():
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9]])
    documents = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1]])
    targets = torch.tensor([[False, True, True, True, False, False, True, True, True]])
    return batch_from_rows(tokens, documents, targets)


def test_importance_weights_token_and_sequence() -> None:
    batch = _two_document_batch()
    mask = batch.labels != -100
    train = torch.zeros(batch.labels.shape).masked_fill(mask, -1.0)
    sampler = train.clone()
    sampler[mask] = torch.tensor([-1.5, -0.5, -1.2, -2.0, -1.0, -1.0])  # gaps 0.5, -0.5, 0.2 | 1.0, 0, 0
    token = importance_weights(batch, train, sampler, ImportanceSamplingConfig(mode="token_truncate", cap=2.0))
    want = torch.tensor([math.exp(0.5), math.exp(-0.5), math.exp(0.2), 2.0, 1.0, 1.0])
    assert torch.allclose(token[mask], want.float())
    assert torch.all(token[~mask] == 1.0)
    sequence = importance_weights(batch, train, sampler, ImportanceSamplingConfig(mode="sequence_truncate", cap=2.0))
    want = torch.tensor([math.exp(0.2)] * 3 + [2.0] * 3)
    assert torch.allclose(sequence[mask], want.float())
    assert importance_weights(batch, train, sampler, ImportanceSamplingConfig()) is None
    truncate = ImportanceSamplingConfig(mode="token_truncate", cap=2.0)
    metrics = gap_metrics(torch.stack([gap_statistics(batch, train, sampler, token, truncate)]), with_weights=True)
    assert metrics["sampling/logp_diff/max"] == pytest.approx(1.0)
    assert metrics["sampling/logp_diff/mean"] == pytest.approx(2.2 / 6)
    assert metrics["sampling/importance_ratio/max"] == pytest.approx(2.0)


def test_rollout_prompt_too_long_is_named() -> None:
    from fastlm.generation import NativeBackend, SamplingOptions
    from fastlm.rl.rollout import encode_prompts, generate_checked
    from tests.rl.rl_helpers import tiny_model

    tokenizer = ByteTokenizer()
    texts = ["1+1=", "x" * 60]
    backend = NativeBackend(tiny_model(), tokenizer)
    with pytest.raises(DataError, match=r"rollout prompt \('xxxx.*prompt 1 has 61 tokens, more than model.max_seq_len \(48\)"):
        generate_checked(backend, encode_prompts(tokenizer, texts), texts, SamplingOptions(4), None)
