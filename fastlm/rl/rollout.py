"""One rollout, top to bottom: prompts -> generation backend -> rewards -> advantages -> pack -> old log-probs.

`collect_rollout` is the whole of it; the trainer calls it with its model, its policy head and its
generation backend (fastlm/generation/backend.py) whenever a new rollout is due. Each step is a small
function below, in the order the rollout runs them:

1. prompts: `prompts_per_rollout` records from the built-in task or a JSONL data set (fastlm/rl/prompts.py).
2. generation: G completions per record from the backend, after it has synced the current weights; the
   sampler's own log-probs come back with the tokens.
3. rewards: the reward functions score every completion (fastlm/rl/rewards.py). Multi-turn (`rl.environment`,
   fastlm/rl/environments): generation and rewards alternate, each prompt record starts G episodes whose
   policy turns and environment replies share one KV cache; an episode holds at most
   min(data.seq_len + 1, model.max_seq_len - max_new_tokens - 1) tokens, only the policy's tokens are
   targets, and the environment gives the reward.
4. advantages: group-normalised rewards (fastlm/rl/advantages.py).
5. pack: whole documents into rows of data.seq_len + 1 tokens, split into exactly `grad_accumulation`
   micro-batches (one optimizer step covers the rollout; fastlm/rl/packing.py). With `rl.teacher` a frozen
   teacher then scores every sampled token and its reverse KL joins the advantages (fastlm/rl/teacher.py).
6. old log-probs: the training forward of the packed batch under the policy head's transform (logits / T,
   the distribution the RL head trains), so the first update's ratio is 1 up to rounding. The sampler's
   log-probs they replace give the sampler-vs-trainer gap metrics and, optionally, the truncated importance
   sampling weights folded into the advantages (fastlm/rl/consistency.py). With `rl.old_logprobs: sampler`
   this forward is skipped and the sampler's log-probs stay the old ones (verl's bypass mode).

Data parallel (`RolloutShard`): `rl.prompts_per_rollout` is per dp rank, like `data.micro_batch_size`, so a
global rollout holds `prompts_per_rollout * dp` prompts. Every rank draws the whole global prompt list from
the same seeded stream and keeps its block (rank r: prompts r*P .. r*P + P - 1), and samples with its own
generator (fastlm/rl/stream.py seeds it), so no two ranks train on the same completions. The per-completion
rewards, lengths and stop flags are all-gathered: advantages (the batch std included) and rollout metrics
are those of the global rollout, identical on every rank. dp = 1 is the plain run.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from fastlm.data.batch import Batch
from fastlm.data.datasets import DataError
from fastlm.data.offline_rl import PolicySample
from fastlm.data.tasks import Task
from fastlm.data.tokenizer import Tokenizer
from fastlm.generation import Completion, GenerationBackend, SamplingOptions
from fastlm.layers.lm_head import LMHead
from fastlm.lora.attach import merged_weights
from fastlm.losses.children.policy import PolicyConfig
from fastlm.losses.config import LMHeadConfig
from fastlm.losses.spec import ProcessGroup
from fastlm.models.decoder import DecoderLM
from fastlm.rl.advantages import group_advantages, rollout_metrics
from fastlm.rl.config import ImportanceSamplingConfig, RLConfig
from fastlm.rl.consistency import corrected_advantages, gap_metrics, gap_statistics, importance_weights
from fastlm.rl.environments.base import EnvironmentFactory, load_environment
from fastlm.rl.environments.config import BUILT_IN
from fastlm.rl.environments.episodes import run_episodes
from fastlm.rl.environments.transcript import completion_text
from fastlm.rl.packing import pack_policy_samples, policy_logprobs, split_into_batches
from fastlm.rl.prompts import (
    JsonlPrompts,
    PromptRecord,
    PromptSource,
    TaskPrompts,
    build_task,
    encode_prompt,
    stop_token_ids,
    task_reward,
)
from fastlm.rl.rewards import RewardFunction, load_reward_functions, reward_metrics, score_completions, total_reward
from fastlm.rl.teacher import Teacher, add_gkd_inputs, add_teacher_advantages, teacher_metrics


@dataclass(frozen=True)
class RolloutShard:
    """This process's share of a data-parallel rollout: dp rank `index` of `count`, gathering over `group`
    on `device` (nccl needs CUDA tensors). The default is the whole rollout in one process."""

    index: int = 0
    count: int = 1
    group: ProcessGroup | None = None
    device: torch.device = torch.device("cpu")

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """Every dp rank's `values` (same shape on each), concatenated along dim 0 in dp-rank order."""
        if self.group is None:
            return values
        local = values.to(self.device).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.count)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts).to(values.device)

    def gather_objects(self, value: Any) -> list[Any]:
        """Every dp rank's picklable `value`, in dp-rank order (checkpoint state)."""
        if self.group is None:
            return [value]
        gathered: list[Any] = [None] * self.count
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def block(self, values: list[Any]) -> list[Any]:
        """This rank's contiguous block of a list that holds every rank's share in dp-rank order."""
        size = len(values) // self.count
        return values[self.index * size : (self.index + 1) * size]


def rollout_task(config: RLConfig) -> Task:
    """The built-in task a run draws prompts (and eval problems) from: the built-in environment's, else rl.task."""
    if config.environment is not None and config.environment.name == BUILT_IN:
        from fastlm.rl.environments.arithmetic import ToolArithmeticOptions, ToolArithmeticTask

        options = ToolArithmeticOptions(**config.environment.options)
        return ToolArithmeticTask(options.operations, options.max_operand)
    return build_task(config.task)


def sampling_options(rl: RLConfig, head: LMHeadConfig, tokenizer: Tokenizer) -> SamplingOptions:
    """The rollout sampler's settings: stop at `rl.stop_tokens` (default the tokenizer's EOS); the head's logit
    transform so sampling sees the loss's softmax."""
    return SamplingOptions(rl.max_new_tokens, rl.temperature, rl.top_p, rl.top_k, stop_token_ids(rl, tokenizer),
                           logit_scale=head.logit_scale, softcap=head.softcap)


@dataclass(frozen=True)
class RolloutSetup:
    """What every rollout of a run draws from, fixed at the start (user prompts, rewards and environment are
    loaded once, here)."""

    config: RLConfig
    tokenizer: Tokenizer
    options: SamplingOptions
    task: Task
    prompts: PromptSource
    environment: EnvironmentFactory | None
    rewards: list[RewardFunction]
    seq_len: int  # rows hold seq_len + 1 tokens
    micro_batches: int  # trainer.grad_accumulation: a rollout packs into exactly this many
    episode_limit: int  # the most tokens a multi-turn episode holds, prompt included
    shard: RolloutShard = RolloutShard()

    @classmethod
    def build(cls, config: RLConfig, head: LMHeadConfig, tokenizer: Tokenizer, max_seq_len: int, seq_len: int,
              micro_batches: int, shard: RolloutShard = RolloutShard()) -> RolloutSetup:
        options = sampling_options(config, head, tokenizer)
        task = rollout_task(config)
        prompts: PromptSource = TaskPrompts(task)
        if config.prompts is not None:
            prompts = JsonlPrompts(config.prompts, tokenizer, max_seq_len - config.max_new_tokens)
        environment = load_environment(config.environment, config.format_reward,
                                       config.reward_timeout_s) if config.environment else None
        rewards = load_reward_functions(config.rewards, config.reward_timeout_s) if config.rewards else [
            RewardFunction("task", "built-in task reward", task_reward(task, config.format_reward), 1.0)]
        limit = min(seq_len + 1, max_seq_len - config.max_new_tokens - 1)
        return cls(config, tokenizer, options, task, prompts, environment, rewards, seq_len, micro_batches, limit, shard)


@dataclass
class Rollout:
    """One rollout, ready to train on: `micro_batches` batches with old_logp and (corrected) advantages."""

    batches: list[Batch]
    metrics: dict[str, float]  # rollout_metrics, reward or env metrics and the sampling gap; no train/ prefix
    examples: list[dict[str, Any]]  # the first rl.log_completions samples, as text: what a user reads
    seconds: dict[str, float]  # sampling (generation), reward (functions or environment steps), old_logprob


@dataclass
class Scored:
    """This rank's completions (or episodes) and their rewards, before advantages (record-major, G per record)."""

    samples: list[PolicySample]  # advantage 0 until the group advantages are in; old_logp: the sampler's
    columns: torch.Tensor  # (n, 3 + k) float64: total reward, length, stopped, then k columns of per-kind metrics
    shown: list[tuple[str, str]]  # (prompt, completion) of the first rl.log_completions, as text
    reward_seconds: float  # in the reward functions, or the environments' steps (tool calls included)


def collect_rollout(model: DecoderLM, policy_head: LMHead, backend: GenerationBackend, setup: RolloutSetup,
                    prompt_rng: random.Random, generator: torch.Generator | None,
                    amp_dtype: torch.dtype | None = None, teacher: Teacher | None = None, version: int = 0) -> Rollout:
    """Sample, score, advantage and pack one rollout of the current policy, policy `version` (the trainer's
    step; see the module docstring)."""
    config, shard = setup.config, setup.shard
    started = time.perf_counter()
    records = draw_prompts(setup.prompts, prompt_rng, config.prompts_per_rollout, shard)  # 1. prompts
    backend.sync_weights(merged_weights(model), version)
    if setup.environment is None:
        prompts, texts = group_prompts(records, setup.tokenizer, config.group_size)
        completions = generate_checked(backend, prompts, texts, setup.options, generator)  # 2. generation
        scored = score_rollout(setup, records, prompts, completions)  # 3. rewards
        versions = torch.tensor([float(c.policy_version) for c in completions], dtype=torch.float64)
    else:  # 2. + 3. alternate: the environment answers (and rewards) each turn
        scored = play_episodes(backend, setup, records, generator)
        versions = torch.full((len(scored.samples),), float(version), dtype=torch.float64)  # one sync per rollout
    gathered = shard.gather(scored.columns)  # 4. advantages, over every rank's completions (the global rollout)
    versions = shard.gather(versions)  # the policy version each completion was sampled with
    total, lengths, stopped = gathered[:, 0], gathered[:, 1], gathered[:, 2]
    advantages = group_advantages(total, config.group_size, config.scale_rewards, config.advantage_eps)
    samples = [replace(s, advantage=a) for s, a in zip(scored.samples, shard.block(advantages.tolist()))]
    sampled = time.perf_counter()
    rows = pack_policy_samples(samples, setup.seq_len, setup.tokenizer.pad_id, setup.micro_batches)  # 5. pack
    batches = split_into_batches(rows, setup.micro_batches)
    metrics = {**rollout_metrics(total, advantages, lengths, stopped.bool(), config.group_size),
               **(reward_metrics(gathered[:, 3:], setup.rewards) if setup.environment is None
                  else episode_metrics(gathered[:, 3:])),
               "policy_version/min": float(versions.min()), "policy_version/max": float(versions.max())}
    if teacher is not None:  # 5b. the teacher: its reverse KL joins the advantages, or (gkd) its head input the batches
        add = add_gkd_inputs if teacher.config.objective == "gkd" else add_teacher_advantages
        metrics.update(teacher_metrics(shard.gather(add(batches, teacher))))
    scored_by_teacher = time.perf_counter()
    if config.old_logprobs == "trainer":  # 6. old log-probs (and the sampler gap they reveal); else the sampler's
        gaps = shard.gather(add_old_logprobs(batches, model, policy_head, config.importance_sampling, amp_dtype))
        metrics.update(gap_metrics(gaps, config.importance_sampling.mode != "none"))
    finished = time.perf_counter()
    examples = [{"prompt": prompt, "completion": completion, "reward": float(scored.columns[i, 0]),
                 "advantage": samples[i].advantage} for i, (prompt, completion) in enumerate(scored.shown)]
    seconds = {"sampling": sampled - started - scored.reward_seconds, "reward": scored.reward_seconds,
               "teacher": scored_by_teacher - sampled, "old_logprob": finished - scored_by_teacher}
    return Rollout(batches, metrics, examples, seconds)


def draw_prompts(source: PromptSource, rng: random.Random, per_rank: int, shard: RolloutShard) -> list[PromptRecord]:
    """This rank's block of the global rollout's prompt records (every rank draws them all from the same stream)."""
    return shard.block([source.sample(rng) for _ in range(per_rank * shard.count)])


def group_prompts(records: list[PromptRecord], tokenizer: Tokenizer, group: int) -> tuple[list[list[int]], list[str]]:
    """(ids, text) of each record repeated `group` times: one generation request per completion."""
    texts = [record.text for record in records for _ in range(group)]
    return encode_prompts(tokenizer, texts), texts


def encode_prompts(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [encode_prompt(tokenizer, text) for text in texts]


def generate_checked(backend: GenerationBackend, prompts: list[list[int]], texts: list[str], options: SamplingOptions,
                     generator: torch.Generator | None) -> list[Completion]:
    """The backend's request errors (a prompt too long for max_seq_len) name the prompt's text."""
    try:
        return backend.generate(prompts, options, generator)
    except ValueError as error:
        index = next((i for i in range(len(prompts)) if f"prompt {i} " in str(error)), None)
        named = f" ({texts[index][:80]!r})" if index is not None else ""
        raise DataError(f"rollout prompt{named}: {error}") from error


def reward_arguments(records: list[PromptRecord], completions: list[Completion], tokenizer: Tokenizer,
                     group: int) -> dict[str, list[Any]]:
    """The reward functions' keyword arguments for `group` completions per record (record-major): the reserved
    names (prompts, completions, completion_ids, stopped) and each prompt column repeated per completion."""
    arguments: dict[str, list[Any]] = {
        "prompts": [record.shown for record in records for _ in range(group)],
        "completions": [completion_text(c, tokenizer) for c in completions],
        "completion_ids": [list(c.tokens) for c in completions],
        "stopped": [c.stopped for c in completions],
    }
    for column in records[0].columns:
        arguments[column] = [record.columns[column] for record in records for _ in range(group)]
    return arguments


def score_rollout(setup: RolloutSetup, records: list[PromptRecord], prompts: list[list[int]],
                  completions: list[Completion]) -> Scored:
    """The reward functions on single completions; the extra columns are each function's reward."""
    group, functions = setup.config.group_size, setup.rewards
    arguments = reward_arguments(records, completions, setup.tokenizer, group)
    started = time.perf_counter()
    per_function = score_completions(functions, arguments, group, setup.config.nan_rewards)
    reward_seconds = time.perf_counter() - started
    facts = torch.tensor([[len(c.tokens), float(c.stopped)] for c in completions], dtype=torch.float64)
    columns = torch.cat([total_reward(per_function, functions)[:, None], facts, per_function], dim=1)
    samples = [PolicySample(prompt, c.tokens, 0.0, old_logp=list(c.logprobs), routing=c.routing)
               for prompt, c in zip(prompts, completions)]
    shown = [(records[i // group].text, arguments["completions"][i])
             for i in range(min(setup.config.log_completions, len(samples)))]
    return Scored(samples, columns, shown, reward_seconds)


def play_episodes(backend: GenerationBackend, setup: RolloutSetup, records: list[PromptRecord],
                  generator: torch.Generator | None) -> Scored:
    """G multi-turn episodes per record; the extra columns are turns, tool calls and tool errors. The samples
    mask the environment's tokens and carry the sampler's log-probs on the policy's."""
    assert setup.environment is not None
    tokenizer = setup.tokenizer
    episodes, step_seconds = run_episodes(backend, tokenizer, setup.environment, records, setup.config.group_size,
                                          setup.options, generator, setup.episode_limit)
    columns = torch.tensor([[e.reward, e.policy_tokens, float(e.ended), e.turns, e.counts["tool_calls"],
                             e.counts["tool_errors"]] for e in episodes], dtype=torch.float64)
    samples = [PolicySample(e.prompt, e.tokens, 0.0, old_logp=e.logprobs, completion_mask=e.policy) for e in episodes]
    shown = [(tokenizer.decode(e.prompt, skip_special=False), tokenizer.decode(e.tokens, skip_special=False))
             for e in episodes[: setup.config.log_completions]]
    return Scored(samples, columns, shown, step_seconds)


def episode_metrics(columns: torch.Tensor) -> dict[str, float]:
    """env/* statistics of the global rollout's episodes from their (turns, tool calls, tool errors) columns."""
    turns, calls, errors = columns[:, 0], columns[:, 1], columns[:, 2]
    return {"env/turns/mean": float(turns.mean()), "env/turns/max": float(turns.max()),
            "env/tool_calls/mean": float(calls.mean()), "env/tool_errors/mean": float(errors.mean()),
            "env/tool_use_rate": float((calls > 0).double().mean())}


def add_old_logprobs(batches: list[Batch], model: DecoderLM, policy_head: LMHead, correction: ImportanceSamplingConfig,
                     amp_dtype: torch.dtype | None) -> torch.Tensor:
    """Each batch's old_logp from the training forward under the policy head's transform, in place of the
    sampler's log-probs it was packed with; those give the rollout corrections of the advantages and the
    gap statistics returned (one row per batch, `gap_statistics`)."""
    head = policy_head.config
    slope = next((c.first_update_slope() for c in head.losses.values() if isinstance(c, PolicyConfig)), 1.0)
    statistics = []
    for batch in batches:
        sampler_logp = batch.old_logp
        assert sampler_logp is not None
        batch.old_logp = policy_logprobs(model, batch, head.logit_scale, head.softcap, amp_dtype,
                                         policy_head.logits_memory_mib)
        weights = importance_weights(batch, batch.old_logp, sampler_logp, correction)
        batch.advantages = corrected_advantages(batch, batch.old_logp, sampler_logp, correction, weights, slope)
        statistics.append(gap_statistics(batch, batch.old_logp, sampler_logp, weights, correction))
    return torch.stack(statistics)
