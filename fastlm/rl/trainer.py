"""`RLTrainer`: the trainer loop with rollouts (or offline RL samples) as data and a supervised warm-up.

Online (`rl:` set, any data source but offline_rl): the loader is a `RolloutLoader`; the first
`rl.warmup_steps` steps train cross-entropy (+ the head's z_loss) on task demonstrations through a
second head on the same weights, then the configured policy head (GRPO or GSPO) trains on rollouts.
Offline (`data.source.type: offline_rl`): the policy head trains on the file's samples, old_logp and
advantages as given. Rollout statistics and the greedy eval reward join the trainer's log records (the
built-in task's fixed problems, or a prompt data set's eval prompts: rl/eval_prompts.py). A KL penalty's
frozen reference is the policy as RL starts: after a warm-up, a copy taken at the first RL step (of a
LoRA policy: its adapters only, over the shared frozen base).
RL steps run at `rl.lr_scale` times the scheduled lr (the warm-up's lr suits cross-entropy, not the
noisier policy gradient). Data parallel: each dp rank samples its own share of the rollout
(fastlm/rl/rollouts.py), warm-up and offline batches are rank-strided like the base trainer's.
"""

from __future__ import annotations

import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from fastlm.data.batch import Batch
from fastlm.data.config import OfflineRLSource
from fastlm.data.offline_rl import load_offline_rl
from fastlm.data.summary import check_batch_fits
from fastlm.data.tasks import Problem
from fastlm.data.tokenizer import Tokenizer
from fastlm.engine.checkpoint import CheckpointError, save_checkpoint
from fastlm.engine.distributed import RankShardLoader
from fastlm.engine.frozen import copy_frozen, load_frozen_copy, reference_model
from fastlm.engine.optim import lr_multiplier
from fastlm.engine.trainer import StepResult, Trainer, TrainSummary
from fastlm.generation import SamplingOptions
from fastlm.layers.lm_head import LMHead
from fastlm.lora.attach import AdapterSnapshot
from fastlm.lora.layer import full_tensor
from fastlm.losses.children import CrossEntropyConfig
from fastlm.losses.children.policy import PolicyConfig
from fastlm.losses.config import LMHeadConfig
from fastlm.models.decoder import DecoderLM
from fastlm.rl.config import RLConfig
from fastlm.rl.consistency import tempered_transform
from fastlm.rl.eval_prompts import eval_records, evaluate_prompts
from fastlm.rl.packing import PolicyBatchLoader, pack_policy_samples, policy_logprobs
from fastlm.rl.prompts import PromptRecord, stop_token_ids
from fastlm.rl.rewards import RewardError
from fastlm.rl.rollouts import RolloutLoader, RolloutShard, rank_rows, rollout_task

if TYPE_CHECKING:
    from fastlm.run_config.schema import RunConfig

SUMMARY_WINDOW = 3  # rollouts averaged at each end of the run for the reward summary
COMPLETIONS_KEY = "train/completions_table"  # rollout, prompt, completion, reward, advantage per row
REFERENCE_DIR = "reference"  # the KL reference taken at the end of the warm-up, for a resume


@dataclass
class RLSummary(TrainSummary):
    rewards: list[float] = field(default_factory=list)  # mean reward of every rollout
    eval_rewards: list[tuple[int, float]] = field(default_factory=list)  # (step, greedy eval reward)
    rl_start: int = 0  # the last warm-up step (0 without one): its eval is the policy as RL starts


def warmup_head_config(head: LMHeadConfig) -> LMHeadConfig:
    """Cross-entropy plus the policy head's z_loss (if any), same numerics (scale, softcap, path)."""
    losses: dict[str, Any] = {"cross_entropy": CrossEntropyConfig()}
    losses.update({name: child for name, child in head.losses.items() if child.type == "z_loss"})
    return head.model_copy(update={"losses": losses})


def sampling_options(rl: RLConfig, head: LMHeadConfig, tokenizer: Tokenizer) -> SamplingOptions:
    """The rollout sampler's settings: stop at `rl.stop_tokens` (default the tokenizer's EOS); the head's logit
    transform so sampling sees the loss's softmax."""
    return SamplingOptions(rl.max_new_tokens, rl.temperature, rl.top_p, rl.top_k, stop_token_ids(rl, tokenizer),
                           logit_scale=head.logit_scale, softcap=head.softcap)


def policy_head_config(head: LMHeadConfig, temperature: float) -> LMHeadConfig:
    """The RL head trains the sampling distribution: its logit transform divided by the temperature (TRL)."""
    scale, softcap = tempered_transform(head.logit_scale, head.softcap, temperature)
    return head.model_copy(update={"logit_scale": scale, "softcap": softcap})


def rl_scheduler(optimizer: torch.optim.Optimizer, config: RunConfig, rl: RLConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """The run's schedule times `rl.lr_scale` from the first RL step on (step `rl.warmup_steps`; 0 offline)."""
    steps, schedule, first_rl = config.trainer.steps, config.schedule, rl.warmup_steps

    def multiplier(step: int) -> float:
        return lr_multiplier(step, steps, schedule) * (rl.lr_scale if step >= first_rl else 1.0)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


class RLTrainer(Trainer):
    late_reads = False  # each rollout waits for the GPU anyway, and a record reads the latest rollout's state

    def __init__(self, config: RunConfig, rank: int | None = None):
        self.rl = config.rl or RLConfig()
        self.offline = isinstance(config.data.source, OfflineRLSource)
        super().__init__(config, rank)
        # Replaces the base schedule before any step; base_lrs stay the optimizer's initial lr.
        self.scheduler = rl_scheduler(self.optimizer, config, self.rl)
        self.options = sampling_options(self.rl, config.model.head, self.tokenizer)
        tempered = self.rl.temperature not in (0.0, 1.0) and not self.offline
        self.policy_head = LMHead(policy_head_config(config.model.head, self.rl.temperature)) if tempered else self.model.head
        self.warmup_head = LMHead(warmup_head_config(config.model.head))
        self.eval_problems: list[Problem] = []  # the built-in task's
        self.eval_records: list[PromptRecord] = []  # a prompt data set's (rl/eval_prompts.py)
        self.timing = [0.0, 0.0, 0]  # rollout seconds, train seconds, steps since the last log record
        chosen = self.rl.eval_prompts
        if not self.offline and self.rl.prompts is None and isinstance(chosen, int) and chosen:
            rng = random.Random(config.run.seed + 4)
            task = rollout_task(self.rl)
            self.eval_problems = [task.sample(rng) for _ in range(chosen)]
        elif not self.offline and isinstance(self.train_loader, RolloutLoader):
            limit = config.model.max_seq_len - self.rl.max_new_tokens
            self.eval_records, line = eval_records(self.rl, self.train_loader.source, self.tokenizer, limit,
                                                   config.run.seed + 4)
            if self.rank in (None, 0):
                print(line, file=sys.stderr)
        self.eval_rewards: list[tuple[int, float]] = []
        self.logged_rollout = 0  # the last rollout whose completions table was logged

    def build_loaders(self, tokenizer: Tokenizer) -> tuple[RolloutLoader | PolicyBatchLoader | RankShardLoader, None]:
        self.reference = None if self._reference_after_warmup() else self._reference()
        data, seed, parallel = self.config.data, self.config.run.seed, self.parallel
        shard = RolloutShard(parallel.dp_rank, parallel.dp_size, parallel.dp_group, self.device)
        if self.offline:
            samples = load_offline_rl(self.config.data.source.path, tokenizer)
            rows = pack_policy_samples(samples, data.seq_len, tokenizer.pad_id)
            check_batch_fits(rows, None, data.micro_batch_size * shard.count)
            return rank_rows(PolicyBatchLoader(rows, data.micro_batch_size * shard.count, seed), shard), None
        options = sampling_options(self.rl, self.config.model.head, tokenizer)
        loader = RolloutLoader(self.model, self.rl, options, data.seq_len, data.micro_batch_size,
                               self.config.trainer.grad_accumulation, seed, tokenizer, self.amp_dtype, shard)
        return loader, None

    def _kl_child(self) -> tuple[str, PolicyConfig] | None:
        """(name, config) of the policy loss with a KL penalty (`beta` > 0), if any."""
        for name, child in self.config.model.head.losses.items():
            if isinstance(child, PolicyConfig) and child.beta > 0:
                return name, child
        return None

    def _reference(self) -> DecoderLM | None:
        """The frozen reference of a policy loss with `beta` > 0 as RL starts: its `reference_path`
        checkpoint, or a copy of the policy (engine/frozen.py, shared with DPO); None without a KL penalty.
        Without a warm-up that is the initial policy (built before any step; a resume rebuilds it from the
        seed). After a warm-up it is the policy at the first RL step (`_copy_reference_after_warmup`)."""
        found = self._kl_child()
        if found is None:
            return None
        name, child = found
        if self._reference_after_warmup():
            return self._copy_reference_after_warmup()
        field = f"model.head.losses.{name}.reference_path"
        return reference_model(self.model, child.reference_path, field, self.device, self.config.data.seq_len)

    def _reference_after_warmup(self) -> bool:
        """Whether the KL reference is the policy at the end of the warm-up (no `reference_path`)."""
        found = self._kl_child()
        return found is not None and found[1].reference_path is None and bool(self.rl.warmup_steps) and not self.offline

    def _copy_reference_after_warmup(self) -> DecoderLM:
        """The policy as the first RL step starts (the end of the warm-up), not the random initial model:
        copied then and saved to `<run dir>/reference` (rank 0), which a resume past that step loads."""
        saved = self.run_dir / REFERENCE_DIR
        if self.step > self.rl.warmup_steps:
            if not saved.is_dir():
                raise CheckpointError(
                    f"resuming at step {self.step} needs the KL reference saved at the end of the warm-up "
                    f"(step {self.rl.warmup_steps}) in {saved}, which is missing; start the run again, or set "
                    f"model.head.losses.<policy>.reference_path to a checkpoint of the policy at that step")
            return load_frozen_copy(saved, self.model, self.device)
        reference = copy_frozen(self.model, self.device)
        # a LoRA policy's: its adapters only (full tensors: a collective under FSDP, so on every rank)
        state = ({n: full_tensor(v).cpu() for n, v in reference.state.items()}
                 if isinstance(reference, AdapterSnapshot) else reference)
        if self.rank in (None, 0):
            shutil.rmtree(saved, ignore_errors=True)  # an earlier run's (overwrite) never outranks this one
            save_checkpoint(saved, self.step, state, {}, {"step": self.step}, self.config.model_dump(mode="json"), keep=1)
        return reference

    def micro_batches(self) -> list[Batch]:
        """With a reference, each policy batch gets the reference's label log-probs once: the rollout
        loader serves the same batch objects to every update of a rollout, so once per rollout."""
        batches = super().micro_batches()
        if self.reference is None and not self.in_warmup and self._kl_child() is not None:
            self.reference = self._reference()  # the first RL step after a warm-up
        if self.reference is not None and not self.in_warmup:
            head = self.reference.config.head
            scale, softcap = tempered_transform(head.logit_scale, head.softcap, 0.0 if self.offline else self.rl.temperature)
            for batch in batches:
                if batch.ref_logp is None:
                    batch.ref_logp = policy_logprobs(self.reference, batch, scale, softcap, self.amp_dtype)
        return batches

    @property
    def in_warmup(self) -> bool:
        return self.step < self.rl.warmup_steps and not self.offline

    def train_step(self) -> StepResult:
        """One step; its rollout and training seconds are summed for the next log record. A failing reward function
        stops the run after a checkpoint of the last finished step (the loader is as before the rollout)."""
        self.model.head = self.warmup_head if self.in_warmup else self.policy_head
        loader = self.train_loader
        started = time.perf_counter()
        if isinstance(loader, RolloutLoader):
            loader.rollout_seconds = 0.0
        try:
            result = super().train_step()
        except RewardError as error:
            path = self.save()
            raise RewardError(f"{error}; the run stopped before step {self.step + 1}, checkpoint of step {self.step} "
                              f"saved to {path}: fix the function and continue with --resume") from error
        total = time.perf_counter() - started
        rollout = loader.rollout_seconds if isinstance(loader, RolloutLoader) else 0.0
        self.timing = [self.timing[0] + rollout, self.timing[1] + total - rollout, self.timing[2] + 1]
        return result

    def evaluate(self) -> float | None:
        """No held-out loss: an RL run is judged by its greedy eval reward (logged as eval/reward)."""
        return None

    def _eval_due(self) -> bool:
        every, steps = self.config.trainer.eval_every, self.config.trainer.steps
        return bool(self.eval_problems or self.eval_records) and bool(every) and (self.step % every == 0 or self.step == steps)

    def _log_record(self, result: StepResult, tokens_per_second: float) -> dict[str, Any]:
        record: dict[str, Any] = super()._log_record(result, tokens_per_second)
        warmup = self.step <= self.rl.warmup_steps and not self.offline  # the step just taken
        record["train/rl/warmup"] = float(warmup)
        loader = self.train_loader
        rollout, train, steps = self.timing  # per-step means over the steps since the last record
        record["train/timing/rollout_seconds"] = rollout / max(steps, 1)
        record["train/timing/train_seconds"] = train / max(steps, 1)
        self.timing = [0.0, 0.0, 0]
        if isinstance(loader, RolloutLoader) and loader.metrics and not warmup:
            record.update({f"train/{name}": value for name, value in loader.metrics.items()})
            record["train/rl/rollouts"] = float(loader.rollouts)
            if loader.rollouts != self.logged_rollout:  # each rollout's sample completions once (a table)
                record[COMPLETIONS_KEY] = [{"rollout": loader.rollouts, **row} for row in loader.examples]
                self.logged_rollout = loader.rollouts
        if self._eval_due() and isinstance(loader, RolloutLoader):
            if self.eval_problems:  # the built-in task's problems, single completions or whole episodes
                scores = loader.evaluate(self.eval_problems, self.options)
                record.update({f"eval/{name}": value for name, value in scores.items()})
            else:
                scores = evaluate_prompts(loader.engine, loader.tokenizer, self.eval_records, self.options,
                                          loader.reward_functions, self.rl.nan_rewards)
                record.update({f"eval/{name}": value for name, value in scores.items() if name.startswith("rewards/")})
                record["eval/reward"] = scores["reward"]
            self.eval_rewards.append((self.step, scores["reward"]))
        return record

    def train(self, resume: bool = False) -> RLSummary:
        summary = super().train(resume)
        rewards = list(self.train_loader.rewards) if isinstance(self.train_loader, RolloutLoader) else []
        result = RLSummary(**vars(summary), rewards=rewards, eval_rewards=list(self.eval_rewards),
                           rl_start=0 if self.offline else self.rl.warmup_steps)
        if self.rank in (None, 0) and not summary.already_finished:
            print(describe_rl(result), file=sys.stderr)
        return result


def window_means(values: list[float], window: int = SUMMARY_WINDOW) -> tuple[float, float] | None:
    """(mean of the first `window`, mean of the last `window`) values, or None when there are none."""
    if not values:
        return None
    head, tail = values[:window], values[-window:]
    return sum(head) / len(head), sum(tail) / len(tail)


def describe_rl(summary: RLSummary) -> str:
    """The end-of-run lines a user reads: did reward climb?"""
    lines = []
    means = window_means(summary.rewards)
    if means is not None:
        lines.append(f"rl: {len(summary.rewards)} rollouts, train/reward {means[0]:.3f} (first {SUMMARY_WINDOW}) "
                     f"-> {means[1]:.3f} (last {SUMMARY_WINDOW})")
    if summary.eval_rewards:
        (first_step, first), (last_step, last) = summary.eval_rewards[0], summary.eval_rewards[-1]
        start = dict(summary.eval_rewards).get(summary.rl_start) if summary.rl_start else None
        at_start = "" if start is None else f" -> {start:.3f} as RL starts (step {summary.rl_start})"
        lines.append(f"rl: eval/reward (greedy) {first:.3f} at step {first_step}{at_start} -> {last:.3f} at step "
                     f"{last_step}" + ("" if start is None else f" (RL: {last - start:+.3f})"))
    return "\n".join(lines) or "rl: offline run (no rollouts)"
