"""Online rollouts: draw prompts, sample G completions each from the current policy, score, advantage, pack.

`RolloutLoader` is the RL trainer's data source. It serves micro-batches the way the trainer's loader
does (`next_batch`, `state_dict`, `load_state_dict`): first `warmup_steps * grad_accumulation`
supervised micro-batches of task demonstrations, then rollouts. A rollout is packed into exactly
`grad_accumulation` micro-batches (one optimizer step covers it) and served `updates_per_rollout`
times before the next is drawn. old_logp is recomputed with the training forward right after sampling,
before the first update on the rollout (not the sampler's own log-probs, which include temperature
and top-p), so the first update's ratio is 1 up to rounding.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields
from typing import Any

import torch

from fastlm.data.batch import Batch
from fastlm.data.offline_rl import PolicySample
from fastlm.data.tasks import AdditionTask, Problem, ReverseTask, Task, demonstrations, score
from fastlm.data.tokenizer import ByteTokenizer
from fastlm.models.decoder import DecoderLM
from fastlm.rl.advantages import group_advantages, rollout_metrics
from fastlm.rl.config import AdditionTaskConfig, RLConfig, TaskConfig
from fastlm.rl.packing import PolicyBatchLoader, pack_policy_samples, policy_logprobs, split_into_batches
from fastlm.rl.sampler import Completion, SamplingOptions, sample_completions

TOKENIZER = ByteTokenizer()


def build_task(config: TaskConfig) -> Task:
    if isinstance(config, AdditionTaskConfig):
        return AdditionTask(config.max_operand)
    return ReverseTask(config.length, config.alphabet)


def completion_text(completion: Completion) -> str:
    """The answer text before the stop token; other special tokens stay visible (so they cost reward)."""
    body = completion.tokens[:-1] if completion.stopped else completion.tokens
    return TOKENIZER.decode(body, skip_special=False)


@dataclass
class Rollout:
    samples: list[PolicySample]
    metrics: dict[str, float]  # rollout_metrics names, without the train/ prefix


def draw_rollout(
    model: DecoderLM,
    task: Task,
    problems: list[Problem],
    config: RLConfig,
    options: SamplingOptions,
    generator: torch.Generator,
    amp_dtype: torch.dtype | None = None,
) -> Rollout:
    """G completions per problem, scored and group-normalised (prompt-major order)."""
    group = config.group_size
    prompts = [TOKENIZER.encode(p.prompt, bos=True) for p in problems for _ in range(group)]
    completions = sample_completions(model, prompts, options, generator, amp_dtype)
    rewards = torch.tensor(
        [
            score(task, problems[i // group], completion_text(c), c.stopped, config.format_reward)
            for i, c in enumerate(completions)
        ],
        dtype=torch.float64,
    )
    advantages = group_advantages(rewards, group, config.scale_rewards, config.advantage_eps)
    samples = [
        PolicySample(prompt, c.tokens, float(a), None, float(r))
        for prompt, c, a, r in zip(prompts, completions, advantages.tolist(), rewards.tolist())
    ]
    lengths = torch.tensor([len(c.tokens) for c in completions])
    stopped = torch.tensor([c.stopped for c in completions])
    return Rollout(samples, rollout_metrics(rewards, advantages, lengths, stopped, group))


@torch.no_grad()
def evaluate_greedy(
    model: DecoderLM, task: Task, problems: list[Problem], options: SamplingOptions, format_reward: float,
    amp_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """Mean reward and exact-answer accuracy of greedy completions on fixed problems."""
    greedy = SamplingOptions(options.max_new_tokens, 0.0, 1.0, options.stop_token, options.logit_scale, options.softcap)
    prompts = [TOKENIZER.encode(p.prompt, bos=True) for p in problems]
    completions = sample_completions(model, prompts, greedy, torch.Generator(), amp_dtype)
    texts = [completion_text(c) for c in completions]
    rewards = [score(task, p, t, c.stopped, format_reward) for p, t, c in zip(problems, texts, completions)]
    correct = [c.stopped and t == p.answer for p, t, c in zip(problems, texts, completions)]
    return {"reward": sum(rewards) / len(rewards), "accuracy": sum(correct) / len(correct)}


def _batch_state(batch: Batch) -> dict[str, torch.Tensor]:
    return {f.name: getattr(batch, f.name) for f in fields(batch) if getattr(batch, f.name) is not None}


class RolloutLoader:
    """Warm-up demonstrations, then rollouts from the live model (see the module docstring)."""

    def __init__(
        self,
        model: DecoderLM,
        config: RLConfig,
        options: SamplingOptions,
        seq_len: int,
        micro_batch_size: int,
        grad_accumulation: int,
        seed: int,
        amp_dtype: torch.dtype | None = None,
    ):
        self.model = model
        self.config = config
        self.options = options
        self.seq_len = seq_len
        self.grad_accumulation = grad_accumulation
        self.amp_dtype = amp_dtype
        self.task = build_task(config.task)
        self.warmup_batches = config.warmup_steps * grad_accumulation
        self.demos: PolicyBatchLoader | None = None
        if config.warmup_steps:
            shown = demonstrations(self.task, config.warmup_demonstrations, config.warmup_noise, seed + 1)
            samples = [
                PolicySample(TOKENIZER.encode(p.prompt, bos=True), TOKENIZER.encode(p.answer, eos=True), 0.0)
                for p in shown
            ]
            self.demos = PolicyBatchLoader(pack_policy_samples(samples, seq_len), micro_batch_size, seed)
        self.prompt_rng = random.Random(seed + 2)
        self.generator = torch.Generator().manual_seed(seed + 3)
        self.drawn = 0
        self.batches: list[Batch] = []
        self.position = 0
        self.rollouts = 0
        self.metrics: dict[str, float] = {}
        self.rewards: list[float] = []  # mean reward of every rollout, in order

    @property
    def in_warmup(self) -> bool:
        return self.drawn < self.warmup_batches

    def next_rollout(self) -> None:
        """Sample, score and pack a fresh rollout; old_logp from the training forward of the packed batch."""
        problems = [self.task.sample(self.prompt_rng) for _ in range(self.config.prompts_per_rollout)]
        rollout = draw_rollout(self.model, self.task, problems, self.config, self.options, self.generator, self.amp_dtype)
        batches = split_into_batches(pack_policy_samples(rollout.samples, self.seq_len), self.grad_accumulation)
        for batch in batches:
            batch.old_logp = policy_logprobs(
                self.model, batch, self.options.logit_scale, self.options.softcap, self.amp_dtype
            )
        self.batches, self.position = batches, 0
        self.metrics = rollout.metrics
        self.rewards.append(rollout.metrics["reward"])
        self.rollouts += 1

    def next_batch(self) -> Batch:
        if self.in_warmup:
            assert self.demos is not None  # warmup_batches > 0 only with demonstrations
            self.drawn += 1
            return self.demos.next_batch()
        served = self.config.updates_per_rollout * self.grad_accumulation
        if not self.batches or self.position == served:
            self.next_rollout()
        batch = self.batches[self.position % len(self.batches)]
        self.position += 1
        self.drawn += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Everything resume needs, the current rollout included (plain tensors and numbers only)."""
        version, internal, gauss = self.prompt_rng.getstate()
        return {
            "drawn": self.drawn,
            "position": self.position,
            "rollouts": self.rollouts,
            "batches": [_batch_state(b) for b in self.batches],
            "metrics": dict(self.metrics),
            "rewards": list(self.rewards),
            "prompt_rng": [version, list(internal), gauss],
            "generator": self.generator.get_state(),
            "demos": self.demos.state_dict() if self.demos is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drawn, self.position, self.rollouts = int(state["drawn"]), int(state["position"]), int(state["rollouts"])
        self.batches = [Batch(**tensors) for tensors in state["batches"]]
        self.metrics = {k: float(v) for k, v in state["metrics"].items()}
        self.rewards = [float(v) for v in state["rewards"]]
        version, internal, gauss = state["prompt_rng"]
        self.prompt_rng.setstate((version, tuple(internal), gauss))
        self.generator.set_state(state["generator"])
        if self.demos is not None and state["demos"] is not None:
            self.demos.load_state_dict(state["demos"])
