"""RL as objectives of the trainer's loop: offline samples (`PolicyObjective`) or rollouts with a supervised
warm-up (`OnlineRLObjective`).

One online step, top to bottom:

1. `batches`: the first `rl.warmup_steps` steps train on task demonstrations (rl/stream.py); after them, when the
   latest rollout has been served `rl.updates_per_rollout` times, `next_rollout` draws a fresh one with
   `collect_rollout` (rl/rollout.py: prompts -> generation backend -> rewards -> advantages -> pack -> old
   log-probs) from the trainer's model, the policy head and the generation backend. A KL penalty's reference
   log-probs join the batches once per rollout; an on-policy teacher's (rl.teacher) once per rollout too.
2. `head`: the warm-up head (cross-entropy + the head's z_loss) during the warm-up, the policy head after. Both
   are built once; the policy head is the configured head with its logit transform divided by rl.temperature (it
   trains the sampling distribution, as TRL), and its transform also scores the rollouts' old log-probs. The
   model's own head (the configured one) is what the sampler and the greedy eval apply before the temperature.
3. `lr_scale`: RL steps run at `rl.lr_scale` times the scheduled lr (the warm-up's lr suits cross-entropy, not
   the noisier policy gradient).
4. `metrics` adds the latest rollout's statistics, the time split and the completions table to each log record;
   `evaluate` runs the greedy eval (rl/evaluation.py: the built-in task's fixed problems, or a prompt data set's
   eval prompts, rl/eval_prompts.py).

Offline (`data.source.type: offline_rl`): the policy head trains on the file's samples, old_logp and advantages
as given. A KL penalty's frozen reference is the policy as RL starts: after a warm-up, a copy taken at the first
RL step (of a LoRA policy: its adapters only, over the shared frozen base). Data parallel: each dp rank samples
its own share of the rollout (rl/rollout.py); warm-up and offline batches are rank-strided.
"""

from __future__ import annotations

import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from fastlm.data.batch import Batch
from fastlm.data.offline_rl import load_offline_rl
from fastlm.data.summary import check_batch_fits
from fastlm.data.tasks import Problem
from fastlm.data.tokenizer import Tokenizer
from fastlm.engine.checkpoint import CheckpointError, save_checkpoint
from fastlm.engine.frozen import copy_frozen, load_frozen_copy, reference_model
from fastlm.engine.objective import Objective, StepTimes, TrainingParts, TrainSummary
from fastlm.generation import GenerationBackend
from fastlm.layers.lm_head import LMHead
from fastlm.lora.attach import AdapterSnapshot
from fastlm.lora.layer import full_tensor
from fastlm.losses.children import CrossEntropyConfig
from fastlm.losses.config import LMHeadConfig
from fastlm.models.decoder import DecoderLM
from fastlm.rl.config import RLConfig
from fastlm.rl.consistency import tempered_transform
from fastlm.rl.eval_prompts import eval_records
from fastlm.rl.evaluation import greedy_eval
from fastlm.rl.packing import PolicyBatchLoader, pack_policy_samples, policy_logprobs
from fastlm.rl.prefetch import RolloutPrefetch, sampler_replica
from fastlm.rl.prompts import PromptRecord
from fastlm.rl.rewards import RewardError
from fastlm.rl.rollout import Rollout, RolloutSetup, RolloutShard, collect_rollout
from fastlm.rl.stream import RolloutStream, rank_rows
from fastlm.rl.teacher import add_teacher_heads, load_teacher

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


def policy_head_config(head: LMHeadConfig, temperature: float) -> LMHeadConfig:
    """The RL head trains the sampling distribution: its logit transform divided by the temperature (TRL)."""
    scale, softcap = tempered_transform(head.logit_scale, head.softcap, temperature)
    return head.model_copy(update={"logit_scale": scale, "softcap": softcap})


def rollout_backend(model: DecoderLM, tokenizer: Tokenizer, rl: RLConfig, amp_dtype: torch.dtype | None,
                    multi_turn: bool) -> GenerationBackend:
    """`rl.backend`'s generation backend on `model` (fastlm/generation/backend_config.py), kept across rollouts
    (its CUDA graphs too); with `rl.routing_replay` it records each token's experts."""
    return rl.backend.build(model, tokenizer, amp_dtype, multi_turn, record_routing=rl.routing_replay)


def rollout_shard(parts: TrainingParts) -> RolloutShard:
    """This process's share of a rollout or an offline file: its data-parallel rank among the dp ranks."""
    return RolloutShard(parts.parallel.dp_rank, parts.parallel.dp_size, parts.parallel.dp_group, parts.device)


class PolicyObjective(Objective):
    """The policy head on offline samples (old log-probs and advantages from the file); the base of online RL."""

    late_reads = False  # each rollout waits for the GPU anyway, and a record reads the latest rollout's state

    def __init__(self, parts: TrainingParts):
        super().__init__(parts)
        self.rl = parts.config.rl or RLConfig()
        self.kl_child = next(((child, need) for child, need in self.config.model.head.frozen_models()
                              if need.role == "reference"), None)  # a policy loss with a KL penalty
        self.reference = None if self.reference_after_warmup else self.build_reference(0)
        self.loader = self.build_loader(parts)
        tempered = self.temperature not in (0.0, 1.0)
        self.warmup_head = LMHead(warmup_head_config(self.config.model.head))
        self.policy_head = LMHead(policy_head_config(self.config.model.head, self.temperature)) if tempered else self.model.head
        self.rollout_seconds = 0.0  # drawing rollouts since the last log record
        self.eval_rewards: list[tuple[int, float]] = []  # (step, greedy eval reward)

    @property
    def temperature(self) -> float:
        """The sampler's, as the policy head and the reference see it (0: the samples' log-probs as given)."""
        return 0.0

    @property
    def warmup_steps(self) -> int:
        return 0

    def build_loader(self, parts: TrainingParts) -> Any:
        """The file's samples packed into rows; each dp rank keeps its share."""
        config = self.config
        shard = rollout_shard(parts)
        samples = load_offline_rl(config.data.source.path, parts.tokenizer)
        rows = pack_policy_samples(samples, config.data.seq_len, parts.tokenizer.pad_id)
        check_batch_fits(rows, None, config.data.micro_batch_size * shard.count)
        return rank_rows(PolicyBatchLoader(rows, config.data.micro_batch_size * shard.count, config.run.seed), shard)

    @property
    def reference_after_warmup(self) -> bool:
        """Whether the KL reference is the policy at the end of the warm-up (no `reference_path`)."""
        return self.kl_child is not None and self.kl_child[1].path is None and bool(self.warmup_steps)

    def build_reference(self, step: int) -> DecoderLM | None:
        """The frozen reference of a policy loss with `beta` > 0 as RL starts: its `reference_path`
        checkpoint, or a copy of the policy (engine/frozen.py, shared with DPO); None without a KL penalty.
        Without a warm-up that is the initial policy (built before any step; a resume rebuilds it from the
        seed). After a warm-up it is the policy at the first RL step (`copy_reference_after_warmup`)."""
        if self.kl_child is None:
            return None
        if self.reference_after_warmup:
            return self.copy_reference_after_warmup(step)
        child, need = self.kl_child
        return reference_model(self.model, need.path, f"{child}.{need.key}", self.device)

    def copy_reference_after_warmup(self, step: int) -> DecoderLM:
        """The policy as the first RL step starts (the end of the warm-up), not the random initial model:
        copied then and saved to `<run dir>/reference` (rank 0), which a resume past that step loads."""
        saved = self.parts.run_dir / REFERENCE_DIR
        if step > self.warmup_steps:
            if not saved.is_dir():
                raise CheckpointError(
                    f"resuming at step {step} needs the KL reference saved at the end of the warm-up "
                    f"(step {self.warmup_steps}) in {saved}, which is missing; start the run again, or set "
                    f"model.head.losses.<policy>.reference_path to a checkpoint of the policy at that step")
            return load_frozen_copy(saved, self.model, self.device)
        reference = copy_frozen(self.model, self.device)
        # a LoRA policy's: its adapters only (full tensors: a collective under FSDP, so on every rank)
        state = ({n: full_tensor(v).cpu() for n, v in reference.state.items()}
                 if isinstance(reference, AdapterSnapshot) else reference)
        if self.parts.verbose:
            shutil.rmtree(saved, ignore_errors=True)  # an earlier run's (overwrite) never outranks this one
            save_checkpoint(saved, step, state, {}, {"step": step}, self.config.model_dump(mode="json"), keep=1)
        return reference

    def in_warmup(self, step: int) -> bool:
        return step < self.warmup_steps

    def head(self, step: int) -> LMHead:
        """The warm-up head during the warm-up, the policy head after it."""
        return self.warmup_head if self.in_warmup(step) else self.policy_head

    def lr_scale(self, step: int) -> float:
        return self.rl.lr_scale if step >= self.warmup_steps else 1.0

    def batches(self, step: int) -> list[Batch]:
        """This step's batches; with a reference, each policy batch gets the reference's label log-probs once (a
        rollout's batch objects are served to each of its updates)."""
        batches = self.draw(step)
        if self.in_warmup(step):
            return batches
        if self.reference is None and self.kl_child is not None:
            self.reference = self.build_reference(step)  # the first RL step after a warm-up
        if self.reference is not None:
            head = self.reference.config.head
            scale, softcap = tempered_transform(head.logit_scale, head.softcap, self.temperature)
            for batch in batches:
                if batch.ref_logp is None:
                    batch.ref_logp = policy_logprobs(self.reference, batch, scale, softcap, self.parts.amp_dtype,
                                                     self.policy_head.logits_memory_mib)
        return batches

    def draw(self, step: int) -> list[Batch]:
        """The step's micro-batches from the loader."""
        return super().batches(step)

    def metrics(self, step: int, times: StepTimes) -> dict[str, Any]:
        """Whether the step was a warm-up step, and the per-step means of rollout and training seconds."""
        steps, rollout = max(times.steps, 1), self.rollout_seconds
        self.rollout_seconds = 0.0
        return {"train/rl/warmup": float(step <= self.warmup_steps),
                "train/timing/rollout_seconds": rollout / steps,
                "train/timing/train_seconds": (times.seconds - rollout) / steps}

    def rewards(self) -> list[float]:
        """The mean reward of every rollout (none offline)."""
        return []

    def finish(self, summary: TrainSummary) -> RLSummary:
        """The summary with the rewards, and the lines that say whether reward climbed."""
        result = RLSummary(**vars(summary), rewards=self.rewards(), eval_rewards=list(self.eval_rewards),
                           rl_start=self.warmup_steps)
        if self.parts.verbose and not summary.already_finished:
            print(describe_rl(result), file=sys.stderr)
        return result


class OnlineRLObjective(PolicyObjective):
    """Rollouts of the current policy as data, after a supervised warm-up; see the module docstring."""

    def __init__(self, parts: TrainingParts):
        super().__init__(parts)
        config = parts.config
        self.backend = rollout_backend(self.model, parts.tokenizer, self.rl, parts.amp_dtype,
                                       multi_turn=self.setup.environment is not None)
        self.phase_seconds = dict.fromkeys(("sampling", "reward", "teacher", "old_logprob"), 0.0)  # summed over steps
        # rl.max_policy_lag: the next rollout is sampled ahead from a replica of the weights (rl/prefetch.py)
        self.prefetch = RolloutPrefetch(sampler_replica(self.model)) if self.rl.max_policy_lag else None
        self.sampler_backend = self.backend if self.prefetch is None else rollout_backend(
            self.prefetch.replica, parts.tokenizer, self.rl, parts.amp_dtype, multi_turn=self.setup.environment is not None)
        self.lags: list[int] = []  # per trained micro-batch since the last record: steps since its sampling weights
        self.stale = 0  # micro-batch slots dropped as too stale since the last record
        self.teacher = None if self.rl.teacher is None else load_teacher(
            self.rl.teacher, self.rl.temperature, self.device, parts.amp_dtype, self.policy_head.logits_memory_mib)
        self.eval_problems: list[Problem] = []  # the built-in task's
        self.eval_records: list[PromptRecord] = []  # a prompt data set's (rl/eval_prompts.py)
        chosen = self.rl.eval_prompts
        if self.rl.prompts is None and isinstance(chosen, int) and chosen:
            rng = random.Random(config.run.seed + 4)
            self.eval_problems = [self.setup.task.sample(rng) for _ in range(chosen)]
        else:
            limit = config.model.max_seq_len - self.rl.max_new_tokens
            self.eval_records, line = eval_records(self.rl, self.setup.prompts, parts.tokenizer, limit, config.run.seed + 4)
            if parts.verbose:
                print(line, file=sys.stderr)
        self.logged_rollout = 0  # the last rollout whose completions table was logged

    @property
    def temperature(self) -> float:
        return self.rl.temperature

    @property
    def warmup_steps(self) -> int:
        return self.rl.warmup_steps

    def build_loader(self, parts: TrainingParts) -> RolloutStream:
        """The rollout stream: demonstrations during the warm-up, then rollouts."""
        config = self.config
        shard = rollout_shard(parts)
        self.setup = RolloutSetup.build(self.rl, config.model.head, parts.tokenizer, config.model.max_seq_len,
                                        config.data.seq_len, config.trainer.grad_accumulation, shard)
        return RolloutStream(self.setup, config.data.micro_batch_size, config.run.seed, self.model.output_weight.device)

    def draw(self, step: int) -> list[Batch]:
        """The step's micro-batches, drawing a fresh rollout whenever the latest one is used up. A failing reward
        function or environment stops the run after a checkpoint of the last finished step (the stream is as
        before the rollout). GKD's teacher heads join each rollout batch once (a checkpoint leaves them out)."""
        batches, stream = [], self.loader
        for _ in range(self.config.trainer.grad_accumulation):
            if (self.prefetch is not None and not stream.rollout_due and self.rl.stale_samples == "drop"
                    and step - stream.version > self.rl.max_policy_lag):
                self.stale += stream.expire()  # its remaining updates would train on samples too old
            if stream.rollout_due:
                try:
                    self.next_rollout(step)
                except RewardError as error:
                    path = self.parts.save()
                    raise RewardError(f"{error}; the run stopped before step {step + 1}, checkpoint of step {step} "
                                      f"saved to {path}: fix it and continue with --resume") from error
            batches.append(stream.next_batch())
            if self.prefetch is not None and not self.in_warmup(step):
                self.lags.append(step - stream.version)
        if self.teacher is not None and self.teacher.config.objective == "gkd" and not self.in_warmup(step):
            resumed = [batch for batch in batches if batch.teacher_head is None]
            if resumed:
                add_teacher_heads(resumed, self.teacher)
        return batches

    def collect(self, model: DecoderLM, version: int) -> Rollout:
        """One rollout sampled by `model` (the policy, or the sampler's replica of it) holding the weights of
        `version` steps; a failure leaves the stream's prompt and sampling generators as they were."""
        stream = self.loader
        backend = self.backend if model is self.model else self.sampler_backend
        with stream.restored_on_failure():
            return collect_rollout(model, self.policy_head, backend, self.setup, stream.prompt_rng, stream.generator,
                                   self.parts.amp_dtype, self.teacher, version)

    def next_rollout(self, step: int) -> None:
        """Serve a new rollout from this step (`step` optimizer steps done) on: one sampled now by the current
        policy, or (rl.max_policy_lag) the one sampled ahead at the previous due point, after which the replica
        takes the current weights and samples the next while this one trains. Rollout seconds are the wait."""
        stream, started = self.loader, time.perf_counter()
        if self.prefetch is None:
            rollout, version = self.collect(self.model, step), step
        else:
            if stream.pending is None:  # the first rollout (or a resume that held none): sampled by the current weights
                self.sample_ahead(step)
            pending, version, stream.pending = stream.pending, stream.pending_version, None
            rollout = self.prefetch.wait(pending)
            self.sample_ahead(step)
        stream.start(rollout, version)
        for phase, seconds in rollout.seconds.items():
            self.phase_seconds[phase] += seconds
        self.rollout_seconds += time.perf_counter() - started if self.prefetch else sum(rollout.seconds.values())

    def sample_ahead(self, step: int) -> None:
        """The replica takes the current weights (`step` optimizer steps) and starts sampling the next rollout."""
        assert self.prefetch is not None
        self.prefetch.sync(self.model, step)
        self.loader.pending = self.prefetch.submit(lambda replica: self.collect(replica, step))
        self.loader.pending_version = step

    def evaluate(self, step: int) -> dict[str, float]:
        """The greedy eval (rl/evaluation.py: eval/reward and the task's accuracy or the reward functions'
        statistics); an RL run has no held-out loss."""
        if not (self.eval_problems or self.eval_records):
            return {}
        scores = greedy_eval(self.backend, self.setup, self.eval_problems, self.eval_records, step)
        self.eval_rewards.append((step, scores["eval/reward"]))
        return scores

    def metrics(self, step: int, times: StepTimes) -> dict[str, Any]:
        """The time split, then the latest rollout's statistics and (once per rollout) its completions table."""
        record = super().metrics(step, times)
        if self.prefetch is not None and (self.lags or self.stale):
            lags = self.lags or [0]
            record.update({"train/rollout/policy_lag": sum(lags) / len(lags), "train/rollout/policy_lag_max": max(lags),
                           "train/rollout/stale_fraction": self.stale / (self.stale + len(self.lags))})
            self.lags, self.stale = [], 0
        stream = self.loader
        if stream.metrics and step > self.warmup_steps:
            record.update({f"train/{name}": value for name, value in stream.metrics.items()})
            record["train/rl/rollouts"] = float(stream.rollouts)
            if stream.rollouts != self.logged_rollout:  # each rollout's sample completions once (a table)
                record[COMPLETIONS_KEY] = [{"rollout": stream.rollouts, **row} for row in stream.examples]
                self.logged_rollout = stream.rollouts
        return record

    def rewards(self) -> list[float]:
        return list(self.loader.rewards)

    def finish(self, summary: TrainSummary) -> RLSummary:
        if self.prefetch is not None:  # a rollout still sampled ahead is not needed: wait for the worker to end
            self.prefetch.close()
        return super().finish(summary)


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
