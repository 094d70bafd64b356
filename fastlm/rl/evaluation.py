"""The RL run's greedy eval (`eval/*`): the policy decoded at temperature 0 on fixed problems or prompts.

The built-in task's problems are scored by the task (single completions, or whole episodes of the
environment: accuracy means the last turn is right); a prompt data set's eval prompts (rl/eval_prompts.py
picks them) by the run's reward functions, so `eval/reward` is the same quantity as `train/reward` at
temperature 0 (a completion no function scored is left out of the mean, as in the advantages).
"""

from __future__ import annotations

import math

import torch

from fastlm.data.tasks import Problem, Task
from fastlm.data.tokenizer import Tokenizer
from fastlm.generation import GenerationBackend, SamplingOptions
from fastlm.rl.environments.base import EnvironmentFactory
from fastlm.rl.environments.episodes import run_episodes
from fastlm.rl.environments.transcript import completion_text
from fastlm.rl.prompts import PromptRecord, task_reward
from fastlm.rl.rewards import RewardFunction, reward_metrics, score_completions, total_reward
from fastlm.rl.rollout import RolloutSetup, encode_prompts, generate_checked, reward_arguments


def greedy_eval(backend: GenerationBackend, setup: RolloutSetup, problems: list[Problem],
                records: list[PromptRecord], version: int = 0) -> dict[str, float]:
    """The eval record of the current weights (policy `version`; the backend reads them from the model it was
    built on): the built-in task's `problems`, else the eval prompt `records`."""
    backend.sync_weights(None, version)
    if problems and setup.environment is None:
        scores = evaluate_task(backend, setup.tokenizer, setup.task, problems, setup.options, setup.config.format_reward)
    elif problems:
        assert setup.environment is not None
        scores = evaluate_episodes(backend, setup.tokenizer, setup.environment, setup.task, problems, setup.options,
                                   setup.episode_limit)
    else:
        scores = evaluate_prompts(backend, setup.tokenizer, records, setup.options, setup.rewards, setup.config.nan_rewards)
    return {f"eval/{name}": value for name, value in scores.items()}


def greedy(options: SamplingOptions) -> SamplingOptions:
    """The rollout options at temperature 0 (same budget, stop tokens and logit transform)."""
    return SamplingOptions(options.max_new_tokens, 0.0, stop_tokens=options.stop_tokens,
                           logit_scale=options.logit_scale, softcap=options.softcap)


@torch.no_grad()
def evaluate_task(backend: GenerationBackend, tokenizer: Tokenizer, task: Task, problems: list[Problem],
                  options: SamplingOptions, format_reward: float) -> dict[str, float]:
    """Mean reward and accuracy of greedy completions on fixed problems (the built-in task's reward)."""
    texts = [p.prompt for p in problems]
    completions = generate_checked(backend, encode_prompts(tokenizer, texts), texts, greedy(options), None)
    answers = [completion_text(c, tokenizer) for c in completions]
    scores = task_reward(task, format_reward)(texts, answers, [c.stopped for c in completions], [p.answer for p in problems])
    correct = [c.stopped and task.is_correct(p, a) for p, a, c in zip(problems, answers, completions)]
    return {"reward": sum(scores) / len(scores), "accuracy": sum(correct) / len(correct)}


@torch.no_grad()
def evaluate_episodes(backend: GenerationBackend, tokenizer: Tokenizer, factory: EnvironmentFactory, task: Task,
                      problems: list[Problem], options: SamplingOptions, limit: int) -> dict[str, float]:
    """Mean reward and accuracy of greedy episodes on fixed problems (accuracy: the last turn is correct)."""
    records = [PromptRecord(p.prompt, {"answer": p.answer}) for p in problems]
    episodes, _ = run_episodes(backend, tokenizer, factory, records, 1, greedy(options), None, limit)
    correct = [e.ended and task.is_correct(p, e.messages[-1]["content"]) for p, e in zip(problems, episodes)]
    return {"reward": sum(e.reward for e in episodes) / len(episodes), "accuracy": sum(correct) / len(correct),
            "tool_use_rate": sum(e.counts["tool_calls"] > 0 for e in episodes) / len(episodes)}


@torch.no_grad()
def evaluate_prompts(backend: GenerationBackend, tokenizer: Tokenizer, records: list[PromptRecord],
                     options: SamplingOptions, functions: list[RewardFunction], nan_policy: str = "error") -> dict[str, float]:
    """`reward` (mean total reward of the greedy completions) and each function's `rewards/<name>/...`."""
    texts = [record.text for record in records]
    completions = generate_checked(backend, encode_prompts(tokenizer, texts), texts, greedy(options), None)
    per_function = score_completions(functions, reward_arguments(records, completions, tokenizer, 1), 1, nan_policy)
    total = total_reward(per_function, functions)
    scored = total[~total.isnan()]
    return {"reward": float(scored.mean()) if scored.numel() else math.nan, **reward_metrics(per_function, functions)}
