"""Online rollouts: draw prompts, sample G completions each from the current policy, score, advantage, pack.

`RolloutLoader` is the RL trainer's data source. It serves micro-batches the way the trainer's loader
does (`next_batch`, `state_dict`, `load_state_dict`): first `warmup_steps * grad_accumulation`
supervised micro-batches of task demonstrations, then rollouts. A rollout is packed into exactly
`grad_accumulation` micro-batches (one optimizer step covers it) and served `updates_per_rollout`
times before the next is drawn. old_logp is recomputed with the training forward right after sampling,
before the first update on the rollout (not the sampler's own log-probs, which include temperature
and top-p), so the first update's ratio is 1 up to rounding.

Data parallel (`RolloutShard`): `rl.prompts_per_rollout` is per dp rank, like `data.micro_batch_size`,
so a global rollout holds `prompts_per_rollout * dp` prompts. Every rank draws the whole global prompt
list from the same seeded stream and keeps its block (rank r: prompts r*P .. r*P + P - 1), and samples
with its own generator (seed + 3 + SEED_STRIDE * r), so no two ranks train on the same completions. The
per-completion rewards, lengths and stop flags are all-gathered: advantages (the batch std included)
and rollout metrics are those of the global rollout, identical on every rank. dp = 1 is the plain run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist

from fastlm.data.batch import Batch
from fastlm.data.offline_rl import PolicySample
from fastlm.data.tasks import AdditionTask, Problem, ReverseTask, Task, demonstrations, score
from fastlm.data.tokenizer import Tokenizer
from fastlm.engine.distributed import RankShardLoader
from fastlm.losses.spec import ProcessGroup
from fastlm.models.decoder import DecoderLM
from fastlm.rl.advantages import group_advantages, rollout_metrics
from fastlm.rl.config import AdditionTaskConfig, RLConfig, TaskConfig
from fastlm.rl.packing import PolicyBatchLoader, pack_policy_samples, policy_logprobs, split_into_batches
from fastlm.rl.sampler import Completion, SamplingOptions, sample_completions

SEED_STRIDE = 1_000_003  # between the sampling seeds of dp ranks (a prime: runs with nearby seeds never share one)


def build_task(config: TaskConfig) -> Task:
    if isinstance(config, AdditionTaskConfig):
        return AdditionTask(config.max_operand)
    return ReverseTask(config.length, config.alphabet)


def completion_text(completion: Completion, tokenizer: Tokenizer) -> str:
    """The answer text before the stop token; other special tokens stay visible (so they cost reward)."""
    body = completion.tokens[:-1] if completion.stopped else completion.tokens
    return tokenizer.decode(body, skip_special=False)


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


def draw_rollout(
    model: DecoderLM,
    task: Task,
    problems: list[Problem],
    config: RLConfig,
    options: SamplingOptions,
    generator: torch.Generator,
    tokenizer: Tokenizer,
    amp_dtype: torch.dtype | None = None,
    shard: RolloutShard = RolloutShard(),
) -> Rollout:
    """G completions per problem of this rank, scored and group-normalised (prompt-major order).

    Advantages and metrics come from the global rollout (every rank's rewards, see the module docstring);
    the samples are this rank's.
    """
    group = config.group_size
    prompts = [tokenizer.encode(p.prompt, bos=True) for p in problems for _ in range(group)]
    completions = sample_completions(model, prompts, options, generator, amp_dtype)
    local = torch.tensor(
        [
            [score(task, problems[i // group], completion_text(c, tokenizer), c.stopped, config.format_reward),
             len(c.tokens), float(c.stopped)]
            for i, c in enumerate(completions)
        ],
        dtype=torch.float64,
    )
    rewards, lengths, stopped = shard.gather(local).unbind(1)
    advantages = group_advantages(rewards, group, config.scale_rewards, config.advantage_eps)
    samples = [
        PolicySample(prompt, c.tokens, float(a))
        for prompt, c, a in zip(prompts, completions, shard.block(advantages.tolist()))
    ]
    examples = [
        {"prompt": problems[i // group].prompt, "completion": completion_text(c, tokenizer), "reward": float(local[i, 0]),
         "advantage": sample.advantage}
        for i, (c, sample) in enumerate(zip(completions[: config.log_completions], samples))
    ]
    return Rollout(samples, rollout_metrics(rewards, advantages, lengths, stopped.bool(), group), examples)


@torch.no_grad()
def evaluate_greedy(
    model: DecoderLM, task: Task, problems: list[Problem], options: SamplingOptions, format_reward: float,
    tokenizer: Tokenizer, amp_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """Mean reward and exact-answer accuracy of greedy completions on fixed problems."""
    greedy = replace(options, temperature=0.0, top_p=1.0)
    prompts = [tokenizer.encode(p.prompt, bos=True) for p in problems]
    completions = sample_completions(model, prompts, greedy, torch.Generator(), amp_dtype)
    texts = [completion_text(c, tokenizer) for c in completions]
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
        tokenizer: Tokenizer,
        amp_dtype: torch.dtype | None = None,
        shard: RolloutShard = RolloutShard(),
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.options = options
        self.seq_len = seq_len
        self.grad_accumulation = grad_accumulation
        self.amp_dtype = amp_dtype
        self.shard = shard
        self.seed = seed
        self.task = build_task(config.task)
        self.warmup_batches = config.warmup_steps * grad_accumulation
        self.demos: PolicyBatchLoader | RankShardLoader | None = None
        if config.warmup_steps:
            shown = demonstrations(self.task, config.warmup_demonstrations, config.warmup_noise, seed + 1)
            samples = [
                PolicySample(tokenizer.encode(p.prompt, bos=True), tokenizer.encode(p.answer, eos=True), 0.0)
                for p in shown
            ]
            self.demos = rank_rows(PolicyBatchLoader(pack_policy_samples(samples, seq_len, tokenizer.pad_id),
                                                     micro_batch_size * shard.count, seed), shard)
        self.prompt_rng = random.Random(seed + 2)
        self.generator = torch.Generator().manual_seed(self.sampling_seed())
        self.drawn = 0
        self.batches: list[Batch] = []
        self.position = 0
        self.rollouts = 0
        self.metrics: dict[str, float] = {}
        self.examples: list[dict[str, Any]] = []  # the latest rollout's, for the completions table
        self.rewards: list[float] = []  # mean reward of every rollout, in order

    @property
    def in_warmup(self) -> bool:
        return self.drawn < self.warmup_batches

    def sampling_seed(self, rollouts: int = 0) -> int:
        """This dp rank's sampling seed; `rollouts` > 0 re-seeds a resumed run past the rollouts already drawn."""
        return self.seed + 3 + SEED_STRIDE * self.shard.index + rollouts

    def next_rollout(self) -> None:
        """Sample, score and pack a fresh rollout; old_logp from the training forward of the packed batch."""
        count = self.config.prompts_per_rollout * self.shard.count
        problems = self.shard.block([self.task.sample(self.prompt_rng) for _ in range(count)])
        rollout = draw_rollout(self.model, self.task, problems, self.config, self.options, self.generator,
                               self.tokenizer, self.amp_dtype, self.shard)
        rows = pack_policy_samples(rollout.samples, self.seq_len, self.tokenizer.pad_id)
        batches = split_into_batches(rows, self.grad_accumulation)
        for batch in batches:
            batch.old_logp = policy_logprobs(
                self.model, batch, self.options.logit_scale, self.options.softcap, self.amp_dtype
            )
        self.batches, self.position = batches, 0
        self.metrics = rollout.metrics
        self.examples = rollout.examples
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
