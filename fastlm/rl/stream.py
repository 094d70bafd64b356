"""The RL trainer's data source: warm-up demonstrations, then rollouts, each served `rl.updates_per_rollout` times.

`RolloutStream` serves micro-batches the way the trainer's loader does (`next_batch`, `state_dict`,
`load_state_dict`): first `warmup_steps * grad_accumulation` supervised micro-batches of task
demonstrations, then the batches of the latest rollout, `updates_per_rollout` times over. It never sees the
model: when `rollout_due`, the trainer draws the next rollout (fastlm/rl/rollout.py) with the stream's
prompt generator and sampling generator and hands it to `start`. A rollout that fails (a reward function,
a bad prompt) leaves both generators as they were (`restored_on_failure`), so the trainer can checkpoint
the last finished step. The checkpointed state holds the rollout in flight, every dp rank's, so a resume
at the same dp size continues it exactly.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import fields
from typing import Any

import torch

from fastlm.config.errors import ConfigError, ConfigIssue
from fastlm.data.batch import Batch
from fastlm.data.datasets import DataError
from fastlm.data.offline_rl import PolicySample
from fastlm.data.tasks import demonstrations
from fastlm.engine.distributed import RankShardLoader
from fastlm.rl.environments.transcript import demonstration_sample
from fastlm.rl.packing import PolicyBatchLoader, pack_policy_samples
from fastlm.rl.rewards import RewardError
from fastlm.rl.rollout import Rollout, RolloutSetup, RolloutShard

SEED_STRIDE = 1_000_003  # between the sampling seeds of dp ranks (a prime: runs with nearby seeds never share one)


def rank_rows(loader: PolicyBatchLoader, shard: RolloutShard) -> PolicyBatchLoader | RankShardLoader:
    """This dp rank's rows of a loader built with micro_batch_size * dp (the base trainer's data mapping)."""
    return loader if shard.count == 1 else RankShardLoader(loader, shard.index, shard.count)


def warmup_demonstrations(setup: RolloutSetup, seed: int) -> list[PolicySample]:
    """The warm-up's solved samples: the task's (prompt, answer) pairs, or the environment's conversations
    tokenized as its rollouts are (only the assistant turns are targets)."""
    config, tokenizer, environment = setup.config, setup.tokenizer, setup.environment
    if environment is None:
        shown = demonstrations(setup.task, config.warmup_demonstrations, config.warmup_noise, seed)
        return [PolicySample(tokenizer.encode(p.prompt, bos=True), tokenizer.encode(p.answer, eos=True), 0.0)
                for p in shown]
    demonstrate = getattr(environment.prototype, "demonstrations", None)
    if not callable(demonstrate):
        raise ConfigError(ConfigIssue("rl.warmup_steps", f"environment '{environment.path}' has no "
                                      "demonstrations(count, noise, seed) for the supervised warm-up",
                                      config.warmup_steps, hint="set rl.warmup_steps: 0"))
    stop = setup.options.stop_tokens[0]
    return [demonstration_sample(tokenizer, conversation, stop)
            for conversation in demonstrate(config.warmup_demonstrations, config.warmup_noise, seed)]


def _batch_state(batch: Batch) -> dict[str, torch.Tensor]:
    """The batch's tensors; not the gkd teacher's head input (its hidden states and output weight: the trainer
    makes it again from the teacher after a resume, rl/objective.py `draw`)."""
    return {f.name: getattr(batch, f.name) for f in fields(batch)
            if getattr(batch, f.name) is not None and f.name != "teacher_head"}


def _rollout_state(rollout: Rollout, version: int) -> dict[str, Any]:
    """A rollout sampled ahead, for a checkpoint (plain tensors, numbers and text)."""
    return {"batches": [_batch_state(b) for b in rollout.batches], "metrics": dict(rollout.metrics),
            "examples": list(rollout.examples), "seconds": dict(rollout.seconds), "version": version}


def _rollout_from_state(state: dict[str, Any]) -> Rollout:
    return Rollout([Batch(**tensors) for tensors in state["batches"]], {k: float(v) for k, v in state["metrics"].items()},
                   list(state["examples"]), {k: float(v) for k, v in state["seconds"].items()})


class RolloutStream:
    """Warm-up demonstrations, then the trainer's rollouts (see the module docstring)."""

    def __init__(self, setup: RolloutSetup, micro_batch_size: int, seed: int, device: torch.device) -> None:
        config, shard = setup.config, setup.shard
        self.shard = shard
        self.seed = seed
        self.served_per_rollout = config.updates_per_rollout * setup.micro_batches
        self.warmup_batches = config.warmup_steps * setup.micro_batches
        self.demos: PolicyBatchLoader | RankShardLoader | None = None
        if config.warmup_steps:
            rows = pack_policy_samples(warmup_demonstrations(setup, seed + 1), setup.seq_len, setup.tokenizer.pad_id)
            self.demos = rank_rows(PolicyBatchLoader(rows, micro_batch_size * shard.count, seed), shard)
        self.prompt_rng = random.Random(seed + 2)
        self.generator = torch.Generator(device=device).manual_seed(self.sampling_seed())
        self.drawn = 0
        self.batches: list[Batch] = []
        self.position = 0
        self.rollouts = 0
        self.metrics: dict[str, float] = {}
        self.examples: list[dict[str, Any]] = []  # the latest rollout's, for the completions table
        self.rewards: list[float] = []  # mean reward of every rollout, in order
        self.version = 0  # the policy version (optimizer steps) the served rollout was sampled with
        self.pending: Future[Rollout] | None = None  # the rollout sampled ahead (rl.max_policy_lag; rl/prefetch.py)
        self.pending_version = 0

    @property
    def in_warmup(self) -> bool:
        return self.drawn < self.warmup_batches

    @property
    def rollout_due(self) -> bool:
        """Whether the next batch needs a new rollout: the warm-up is over and the latest one was fully served."""
        return not self.in_warmup and (not self.batches or self.position == self.served_per_rollout)

    def sampling_seed(self, rollouts: int = 0) -> int:
        """This dp rank's sampling seed; `rollouts` > 0 re-seeds a resumed run past the rollouts already drawn."""
        return self.seed + 3 + SEED_STRIDE * self.shard.index + rollouts

    @contextmanager
    def restored_on_failure(self) -> Iterator[None]:
        """A `RewardError` (or bad prompt) inside leaves the prompt stream and the sampling generator as they were."""
        saved = self.prompt_rng.getstate(), self.generator.get_state()
        try:
            yield
        except (RewardError, DataError):
            self.prompt_rng.setstate(saved[0])
            self.generator.set_state(saved[1])
            raise

    def start(self, rollout: Rollout, version: int = 0) -> None:
        """Serve `rollout`'s batches, sampled with the weights of `version` steps, from the next micro-batch on."""
        self.batches, self.position, self.version = rollout.batches, 0, version
        self.metrics = rollout.metrics
        self.examples = rollout.examples
        self.rewards.append(rollout.metrics["reward"])
        self.rollouts += 1

    def expire(self) -> int:
        """End the served rollout now (its samples are too stale to train on); the slots it leaves unserved."""
        left, self.position = self.served_per_rollout - self.position, self.served_per_rollout
        return left

    def next_batch(self) -> Batch:
        if self.in_warmup:
            assert self.demos is not None  # warmup_batches > 0 only with demonstrations
            self.drawn += 1
            return self.demos.next_batch()
        if self.rollout_due:
            raise RuntimeError("the rollout is used up: the trainer starts the next one (rollout_due) first")
        batch = self.batches[self.position % len(self.batches)]
        self.position += 1
        self.drawn += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Everything resume needs, the current rollout included (plain tensors and numbers only).

        Collective under data parallelism: `ranks` holds every dp rank's generator and in-flight rollout
        (rank 0 writes the checkpoint); the rest is the same on every rank.
        """
        pending = _rollout_state(self.pending.result(), self.pending_version) if self.pending is not None else None
        version, internal, gauss = self.prompt_rng.getstate()  # read after the rollout sampled ahead has finished
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
            "version": self.version,
            "pending": pending,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint from another dp size drops the in-flight rollout (a fresh one is drawn next) and
        re-seeds sampling past the rollouts drawn; the same dp size resumes exactly."""
        self.drawn, self.position, self.rollouts = int(state["drawn"]), int(state["position"]), int(state["rollouts"])
        self.version = int(state.get("version", 0))
        self.pending = None
        if state.get("pending") is not None:  # the rollout that was sampled ahead, served as it would have been
            self.pending = Future()
            self.pending.set_result(_rollout_from_state(state["pending"]))
            self.pending_version = int(state["pending"]["version"])
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
