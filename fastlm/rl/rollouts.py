"""Online rollouts: draw prompts, sample G completions each from the current policy, score, advantage, pack.

`RolloutLoader` is the RL trainer's data source. It serves micro-batches the way the trainer's loader
does (`next_batch`, `state_dict`, `load_state_dict`): first `warmup_steps * grad_accumulation`
supervised micro-batches of task demonstrations, then rollouts. A rollout is packed into exactly
`grad_accumulation` micro-batches (one optimizer step covers it) and served `updates_per_rollout`
times before the next is drawn.

Sampling runs on the KV-cache generator (fastlm/generation), kept across rollouts (its CUDA graph too).
Prompts come from the built-in task or a JSONL data set (fastlm/rl/prompts.py), rewards from the task or
user functions (fastlm/rl/rewards.py). old_logp is recomputed with the training forward of the packed
batch right after sampling (so the first update's ratio is 1 up to rounding), under the tempered transform
the RL head trains (logits / T); the sampler's own log-probs are kept long enough to log the gap and,
optionally, weight the tokens by truncated importance sampling (fastlm/rl/consistency.py). A reward
function that fails leaves the loader as it was before the rollout (prompt stream and sampling generator
restored), so the trainer can checkpoint the last finished step.

Multi-turn (`rl.environment`, fastlm/rl/environments): each prompt record starts G episodes of an
environment; the policy's turns and the environment's replies alternate on one KV cache (the generator
then places each row at its own cache columns, `padding="right"`), an episode holds at most
min(data.seq_len + 1, model.max_seq_len - max_new_tokens - 1) tokens, only the policy's tokens are targets,
and the advantage is the episode's. The environment gives the reward and, for the built-in calculator task,
the problems and the warm-up's demonstrations.

Data parallel (`RolloutShard`): `rl.prompts_per_rollout` is per dp rank, like `data.micro_batch_size`,
so a global rollout holds `prompts_per_rollout * dp` prompts. Every rank draws the whole global prompt
list from the same seeded stream and keeps its block (rank r: prompts r*P .. r*P + P - 1), and samples
with its own generator (seed + 3 + SEED_STRIDE * r), so no two ranks train on the same completions. The
per-completion rewards, lengths and stop flags are all-gathered: advantages (the batch std included)
and rollout metrics are those of the global rollout, identical on every rank. dp = 1 is the plain run.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

from fastlm.config.errors import ConfigError, ConfigIssue
from fastlm.data.batch import Batch
from fastlm.data.datasets import DataError
from fastlm.data.offline_rl import PolicySample
from fastlm.data.tasks import Problem, Task, demonstrations
from fastlm.data.tokenizer import Tokenizer
from fastlm.engine.distributed import RankShardLoader
from fastlm.generation import Completion, Generator, SamplingOptions
from fastlm.losses.spec import ProcessGroup
from fastlm.models.decoder import DecoderLM
from fastlm.rl.advantages import group_advantages, rollout_metrics
from fastlm.rl.config import RLConfig
from fastlm.rl.consistency import (
    corrected_advantages,
    gap_metrics,
    gap_statistics,
    importance_weights,
    tempered_transform,
)
from fastlm.rl.environments.base import EnvironmentFactory, load_environment
from fastlm.rl.environments.config import BUILT_IN
from fastlm.rl.environments.episodes import Episode, run_episodes
from fastlm.rl.environments.transcript import completion_text, demonstration_sample
from fastlm.rl.packing import PolicyBatchLoader, pack_policy_samples, policy_logprobs, split_into_batches
from fastlm.rl.prompts import (
    JsonlPrompts,
    PromptRecord,
    PromptSource,
    TaskPrompts,
    build_task,
    encode_prompt,
    task_reward,
)
from fastlm.rl.rewards import (
    RewardError,
    RewardFunction,
    load_reward_functions,
    reward_metrics,
    score_completions,
    total_reward,
)

SEED_STRIDE = 1_000_003  # between the sampling seeds of dp ranks (a prime: runs with nearby seeds never share one)

__all__ = ["RewardError", "RolloutLoader", "RolloutShard", "build_task", "draw_episodes", "draw_rollout",
           "evaluate_greedy", "rollout_task"]


def rollout_task(config: RLConfig) -> Task:
    """The built-in task a run draws prompts (and eval problems) from: the built-in environment's, else rl.task."""
    if config.environment is not None and config.environment.name == BUILT_IN:
        from fastlm.rl.environments.arithmetic import ToolArithmeticOptions, ToolArithmeticTask

        options = ToolArithmeticOptions(**config.environment.options)
        return ToolArithmeticTask(options.operations, options.max_operand)
    return build_task(config.task)


def encode_prompts(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [encode_prompt(tokenizer, text) for text in texts]


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


def generate_checked(engine: Generator, prompts: list[list[int]], texts: list[str], options: SamplingOptions,
                     generator: torch.Generator | None) -> list[Completion]:
    """The generator's request errors (a prompt too long for max_seq_len) name the prompt's text."""
    try:
        return engine.generate(prompts, options, generator)
    except ValueError as error:
        index = next((i for i in range(len(prompts)) if f"prompt {i} " in str(error)), None)
        named = f" ({texts[index][:80]!r})" if index is not None else ""
        raise DataError(f"rollout prompt{named}: {error}") from error


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


@dataclass
class Rollout:
    samples: list[PolicySample]
    metrics: dict[str, float]  # rollout_metrics names, without the train/ prefix
    examples: list[dict[str, Any]]  # the first rl.log_completions samples, as text: what a user reads
    reward_seconds: float = 0.0  # in the reward functions, or the environments' steps (tool calls included)


def draw_rollout(
    engine: Generator,
    tokenizer: Tokenizer,
    records: list[PromptRecord],
    rewards: list[RewardFunction],
    config: RLConfig,
    options: SamplingOptions,
    generator: torch.Generator | None,
    shard: RolloutShard = RolloutShard(),
) -> Rollout:
    """G completions per prompt record of this rank, scored and group-normalised (prompt-major order).

    Advantages and metrics come from the global rollout (every rank's rewards, see the module docstring);
    the samples are this rank's and carry the sampler's log-probs as their old_logp (replaced after packing).
    """
    group = config.group_size
    texts = [record.text for record in records for _ in range(group)]
    prompts = encode_prompts(tokenizer, texts)
    completions = generate_checked(engine, prompts, texts, options, generator)
    arguments = reward_arguments(records, completions, tokenizer, group)
    started = time.perf_counter()
    per_function = score_completions(rewards, arguments, group, config.nan_rewards)
    reward_seconds = time.perf_counter() - started
    facts = torch.tensor([[len(c.tokens), float(c.stopped)] for c in completions], dtype=torch.float64)
    local = torch.cat([total_reward(per_function, rewards)[:, None], facts, per_function], dim=1)
    gathered = shard.gather(local)
    total, lengths, stopped = gathered[:, 0], gathered[:, 1], gathered[:, 2]
    advantages = group_advantages(total, group, config.scale_rewards, config.advantage_eps)
    samples = [
        PolicySample(prompt, c.tokens, float(a), old_logp=list(c.logprobs))
        for prompt, c, a in zip(prompts, completions, shard.block(advantages.tolist()))
    ]
    metrics = rollout_metrics(total, advantages, lengths, stopped.bool(), group)
    metrics.update(reward_metrics(gathered[:, 3:], rewards))
    local_total = local[:, 0].tolist()
    examples = [
        {"prompt": texts[i], "completion": arguments["completions"][i], "reward": local_total[i],
         "advantage": samples[i].advantage}
        for i in range(min(config.log_completions, len(samples)))
    ]
    return Rollout(samples, metrics, examples, reward_seconds)


def draw_episodes(
    engine: Generator,
    tokenizer: Tokenizer,
    records: list[PromptRecord],
    factory: EnvironmentFactory,
    config: RLConfig,
    options: SamplingOptions,
    generator: torch.Generator | None,
    limit: int,
    shard: RolloutShard = RolloutShard(),
) -> Rollout:
    """`draw_rollout` for multi-turn episodes: G per record, rewards from the environment, the advantage per
    episode; the samples mask the environment's tokens and carry the sampler's log-probs on the policy's."""
    group = config.group_size
    episodes, step_seconds = run_episodes(engine, tokenizer, factory, records, group, options, generator, limit)
    local = torch.tensor([[e.reward, e.policy_tokens, float(e.ended), e.turns, e.counts["tool_calls"],
                           e.counts["tool_errors"]] for e in episodes], dtype=torch.float64)
    gathered = shard.gather(local)
    total, lengths, ended = gathered[:, 0], gathered[:, 1], gathered[:, 2]
    advantages = group_advantages(total, group, config.scale_rewards, config.advantage_eps)
    samples = [
        PolicySample(e.prompt, e.tokens, float(a), old_logp=e.logprobs, completion_mask=e.policy)
        for e, a in zip(episodes, shard.block(advantages.tolist()))
    ]
    metrics = rollout_metrics(total, advantages, lengths, ended.bool(), group)
    metrics.update(episode_metrics(gathered[:, 3:]))
    examples = [
        {"prompt": tokenizer.decode(e.prompt, skip_special=False), "completion": _episode_text(e, tokenizer),
         "reward": e.reward, "advantage": sample.advantage}
        for e, sample in list(zip(episodes, samples))[: config.log_completions]
    ]
    return Rollout(samples, metrics, examples, step_seconds)


def _episode_text(episode: Episode, tokenizer: Tokenizer) -> str:
    return tokenizer.decode(episode.tokens, skip_special=False)


def episode_metrics(columns: torch.Tensor) -> dict[str, float]:
    """env/* statistics of the global rollout's episodes from their (turns, tool calls, tool errors) columns."""
    turns, calls, errors = columns[:, 0], columns[:, 1], columns[:, 2]
    return {"env/turns/mean": float(turns.mean()), "env/turns/max": float(turns.max()),
            "env/tool_calls/mean": float(calls.mean()), "env/tool_errors/mean": float(errors.mean()),
            "env/tool_use_rate": float((calls > 0).double().mean())}


@torch.no_grad()
def evaluate_episodes(engine: Generator, tokenizer: Tokenizer, factory: EnvironmentFactory, task: Task,
                      problems: list[Problem], options: SamplingOptions, limit: int) -> dict[str, float]:
    """Mean reward and accuracy of greedy episodes on fixed problems (accuracy: the last turn is correct)."""
    greedy = SamplingOptions(options.max_new_tokens, 0.0, stop_tokens=options.stop_tokens,
                             logit_scale=options.logit_scale, softcap=options.softcap)
    records = [PromptRecord(p.prompt, {"answer": p.answer}) for p in problems]
    episodes, _ = run_episodes(engine, tokenizer, factory, records, 1, greedy, None, limit)
    correct = [e.ended and task.is_correct(p, e.messages[-1]["content"]) for p, e in zip(problems, episodes)]
    return {"reward": sum(e.reward for e in episodes) / len(episodes), "accuracy": sum(correct) / len(correct),
            "tool_use_rate": sum(e.counts["tool_calls"] > 0 for e in episodes) / len(episodes)}


@torch.no_grad()
def evaluate_greedy(
    engine: Generator, tokenizer: Tokenizer, task: Task, problems: list[Problem], options: SamplingOptions,
    format_reward: float,
) -> dict[str, float]:
    """Mean reward and accuracy of greedy completions on fixed problems (the built-in task's reward)."""
    greedy = SamplingOptions(options.max_new_tokens, 0.0, stop_tokens=options.stop_tokens,
                             logit_scale=options.logit_scale, softcap=options.softcap)
    texts = [p.prompt for p in problems]
    completions = generate_checked(engine, encode_prompts(tokenizer, texts), texts, greedy, None)
    answers = [completion_text(c, tokenizer) for c in completions]
    scores = task_reward(task, format_reward)(texts, answers, [c.stopped for c in completions], [p.answer for p in problems])
    correct = [c.stopped and task.is_correct(p, a) for p, a, c in zip(problems, answers, completions)]
    return {"reward": sum(scores) / len(scores), "accuracy": sum(correct) / len(correct)}


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
        tokenizer: Tokenizer,
        amp_dtype: torch.dtype | None = None,
        shard: RolloutShard = RolloutShard(),
    ):
        self.model = model
        self.config = config
        self.options = options
        self.seq_len = seq_len
        self.grad_accumulation = grad_accumulation
        self.amp_dtype = amp_dtype
        self.shard = shard
        self.seed = seed
        self.tokenizer = tokenizer
        self.task = rollout_task(config)
        self.source: PromptSource = TaskPrompts(self.task)
        if config.prompts is not None:
            limit = model.config.max_seq_len - config.max_new_tokens
            self.source = JsonlPrompts(config.prompts, tokenizer, limit)
        self.environment = load_environment(config.environment, config.format_reward) if config.environment else None
        self.episode_limit = min(seq_len + 1, model.config.max_seq_len - config.max_new_tokens - 1)
        self.reward_functions = load_reward_functions(config.rewards, config.reward_timeout_s) if config.rewards else [
            RewardFunction("task", "built-in task reward", task_reward(self.task, config.format_reward), 1.0)]
        device = model.output_weight.device
        graphs = config.cuda_graph and device.type == "cuda" and model.tp_group is None
        self.engine = Generator(model, self.tokenizer, amp_dtype, cuda_graph=graphs, compile=config.compile_decode and graphs,
                                padding="left" if self.environment is None else "right")
        self.train_transform = tempered_transform(options.logit_scale, options.softcap, options.temperature)
        self.warmup_batches = config.warmup_steps * grad_accumulation
        self.demos: PolicyBatchLoader | RankShardLoader | None = None
        if config.warmup_steps:
            samples = self._demonstrations(seed + 1)
            self.demos = rank_rows(PolicyBatchLoader(pack_policy_samples(samples, seq_len, self.tokenizer.pad_id),
                                                     micro_batch_size * shard.count, seed), shard)
        self.prompt_rng = random.Random(seed + 2)
        self.generator = torch.Generator(device=device).manual_seed(self.sampling_seed())
        self.drawn = 0
        self.batches: list[Batch] = []
        self.position = 0
        self.rollouts = 0
        self.metrics: dict[str, float] = {}
        self.examples: list[dict[str, Any]] = []  # the latest rollout's, for the completions table
        self.rewards: list[float] = []  # mean reward of every rollout, in order
        self.rollout_seconds = 0.0  # time spent drawing rollouts since the trainer last read it
        # the same time split: sampling (generation), reward (functions or environment steps), old log-probs
        self.phase_seconds = dict.fromkeys(("sampling", "reward", "old_logprob"), 0.0)

    def _demonstrations(self, seed: int) -> list[PolicySample]:
        """The warm-up's solved samples: the task's (prompt, answer) pairs, or the environment's conversations
        tokenized as its rollouts are (only the assistant turns are targets)."""
        config = self.config
        if self.environment is None:
            shown = demonstrations(self.task, config.warmup_demonstrations, config.warmup_noise, seed)
            return [PolicySample(self.tokenizer.encode(p.prompt, bos=True), self.tokenizer.encode(p.answer, eos=True), 0.0)
                    for p in shown]
        demonstrate = getattr(self.environment.prototype, "demonstrations", None)
        if not callable(demonstrate):
            raise ConfigError(ConfigIssue("rl.warmup_steps", f"environment '{self.environment.path}' has no "
                                          "demonstrations(count, noise, seed) for the supervised warm-up",
                                          config.warmup_steps, hint="set rl.warmup_steps: 0"))
        stop = self.options.stop_tokens[0]
        return [demonstration_sample(self.tokenizer, conversation, stop)
                for conversation in demonstrate(config.warmup_demonstrations, config.warmup_noise, seed)]

    def evaluate(self, problems: list[Problem], options: SamplingOptions) -> dict[str, float]:
        """The greedy eval: single completions scored by the task, or whole episodes of the environment."""
        if self.environment is None:
            return evaluate_greedy(self.engine, self.tokenizer, self.task, problems, options, self.config.format_reward)
        return evaluate_episodes(self.engine, self.tokenizer, self.environment, self.task, problems, options,
                                 self.episode_limit)

    @property
    def in_warmup(self) -> bool:
        return self.drawn < self.warmup_batches

    def sampling_seed(self, rollouts: int = 0) -> int:
        """This dp rank's sampling seed; `rollouts` > 0 re-seeds a resumed run past the rollouts already drawn."""
        return self.seed + 3 + SEED_STRIDE * self.shard.index + rollouts

    def next_rollout(self) -> None:
        """Sample, score and pack a fresh rollout; old_logp from the training forward of the packed batch.

        A `RewardError` (or bad prompt) leaves the prompt stream and the sampling generator as they were."""
        started = time.perf_counter()
        saved = self.prompt_rng.getstate(), self.generator.get_state()
        try:
            count = self.config.prompts_per_rollout * self.shard.count
            records = self.shard.block([self.source.sample(self.prompt_rng) for _ in range(count)])
            if self.environment is None:
                rollout = draw_rollout(self.engine, self.tokenizer, records, self.reward_functions, self.config,
                                       self.options, self.generator, self.shard)
            else:
                rollout = draw_episodes(self.engine, self.tokenizer, records, self.environment, self.config,
                                        self.options, self.generator, self.episode_limit, self.shard)
        except (RewardError, DataError):
            self.prompt_rng.setstate(saved[0])
            self.generator.set_state(saved[1])
            raise
        sampled = time.perf_counter()
        rows = pack_policy_samples(rollout.samples, self.seq_len, self.tokenizer.pad_id)
        batches = split_into_batches(rows, self.grad_accumulation)
        statistics = []
        for batch in batches:
            sampler_logp = batch.old_logp  # packed from the samples: the sampler's own log-probs
            assert sampler_logp is not None
            batch.old_logp = policy_logprobs(self.model, batch, *self.train_transform, self.amp_dtype)
            weights = importance_weights(batch, batch.old_logp, sampler_logp, self.config.importance_sampling)
            batch.advantages = corrected_advantages(batch, batch.old_logp, sampler_logp,
                                                    self.config.importance_sampling, weights)
            statistics.append(gap_statistics(batch, batch.old_logp, sampler_logp, weights))
        gathered = self.shard.gather(torch.stack(statistics))
        self.batches, self.position = batches, 0
        self.metrics = {**rollout.metrics, **gap_metrics(gathered, self.config.importance_sampling.mode != "none")}
        self.examples = rollout.examples
        self.rewards.append(rollout.metrics["reward"])
        self.rollouts += 1
        finished = time.perf_counter()
        self.rollout_seconds += finished - started
        self.phase_seconds["sampling"] += sampled - started - rollout.reward_seconds
        self.phase_seconds["reward"] += rollout.reward_seconds
        self.phase_seconds["old_logprob"] += finished - sampled

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
        """Everything resume needs, the current rollout included (plain tensors and numbers only).

        Collective under data parallelism: `ranks` holds every dp rank's generator and in-flight rollout
        (rank 0 writes the checkpoint); the rest is the same on every rank.
        """
        version, internal, gauss = self.prompt_rng.getstate()
        own = {"batches": [_batch_state(b) for b in self.batches], "generator": self.generator.get_state()}
        return {
            "drawn": self.drawn,
            "position": self.position,
            "rollouts": self.rollouts,
            "ranks": self.shard.gather_objects(own),
            "metrics": dict(self.metrics),
            "rewards": list(self.rewards),
            "prompt_rng": [version, list(internal), gauss],
            "demos": self.demos.state_dict() if self.demos is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint from another dp size drops the in-flight rollout (a fresh one is drawn next) and
        re-seeds sampling past the rollouts drawn; the same dp size resumes exactly."""
        self.drawn, self.position, self.rollouts = int(state["drawn"]), int(state["position"]), int(state["rollouts"])
        self.metrics = {k: float(v) for k, v in state["metrics"].items()}
        self.rewards = [float(v) for v in state["rewards"]]
        version, internal, gauss = state["prompt_rng"]
        self.prompt_rng.setstate((version, tuple(internal), gauss))
        ranks = state["ranks"]
        if len(ranks) == self.shard.count:
            self.batches = [Batch(**tensors) for tensors in ranks[self.shard.index]["batches"]]
            self.generator.set_state(ranks[self.shard.index]["generator"])
        else:
            self.batches = []
            self.generator.manual_seed(self.sampling_seed(self.rollouts))
        if self.demos is not None and state["demos"] is not None:
            self.demos.load_state_dict(state["demos"])


def rank_rows(loader: PolicyBatchLoader, shard: RolloutShard) -> PolicyBatchLoader | RankShardLoader:
    """This dp rank's rows of a loader built with micro_batch_size * dp (the base trainer's data mapping)."""
    return loader if shard.count == 1 else RankShardLoader(loader, shard.index, shard.count)
