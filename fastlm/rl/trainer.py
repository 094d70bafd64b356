"""`RLTrainer`: the trainer loop with rollouts (or offline RL samples) as data and a supervised warm-up.

One online step (`rl:` set, any data source but offline_rl), top to bottom:

1. `micro_batches`: the first `rl.warmup_steps` steps train on task demonstrations (rl/stream.py); after
   them, when the latest rollout has been served `rl.updates_per_rollout` times, `next_rollout` draws a fresh
   one with `collect_rollout` (rl/rollout.py: prompts -> generation backend -> rewards -> advantages -> pack
   -> old log-probs) from this trainer's model, policy head and generation backend. A KL penalty's reference
   log-probs join the batches once per rollout.
2. `forward_backward` through `loss_head`: the warm-up head (cross-entropy + the head's z_loss) during the
   warm-up, the policy head after. The trainer builds both once; the policy head is the configured head with
   its logit transform divided by rl.temperature (it trains the sampling distribution, as TRL), and its
   transform also scores the rollouts' old log-probs. The model's own head (the configured one) is what the
   sampler and the greedy eval apply before the temperature.
3. `optimizer_step`: RL steps run at `rl.lr_scale` times the scheduled lr (the warm-up's lr suits
   cross-entropy, not the noisier policy gradient).
4. Every `trainer.log_every` steps `log_record` adds the latest rollout's statistics, the time split and the
   completions table; every `trainer.eval_every` steps `eval_record` runs the greedy eval (rl/evaluation.py:
   the built-in task's fixed problems, or a prompt data set's eval prompts, rl/eval_prompts.py).

Offline (`data.source.type: offline_rl`): the policy head trains on the file's samples, old_logp and
advantages as given. A KL penalty's frozen reference is the policy as RL starts: after a warm-up, a copy
taken at the first RL step (of a LoRA policy: its adapters only, over the shared frozen base). Data
parallel: each dp rank samples its own share of the rollout (rl/rollout.py), warm-up and offline batches
are rank-strided like the base trainer's.
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
from fastlm.engine.step_scalars import StepValues
from fastlm.engine.trainer import StepResult, Trainer, TrainSummary
from fastlm.generation import GenerationBackend
from fastlm.layers.lm_head import LMHead
from fastlm.lora.attach import AdapterSnapshot
from fastlm.lora.layer import full_tensor
from fastlm.losses.children import CrossEntropyConfig
from fastlm.losses.children.policy import PolicyConfig
from fastlm.losses.config import LMHeadConfig
from fastlm.models.decoder import DecoderLM
from fastlm.rl.config import RLConfig
from fastlm.rl.consistency import tempered_transform
from fastlm.rl.eval_prompts import eval_records
from fastlm.rl.evaluation import greedy_eval
from fastlm.rl.packing import PolicyBatchLoader, pack_policy_samples, policy_logprobs
from fastlm.rl.prompts import PromptRecord
from fastlm.rl.rewards import RewardError
from fastlm.rl.rollout import RolloutSetup, RolloutShard, collect_rollout
from fastlm.rl.stream import RolloutStream, rank_rows
from fastlm.rl.teacher import add_teacher_heads, load_teacher

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


def policy_head_config(head: LMHeadConfig, temperature: float) -> LMHeadConfig:
    """The RL head trains the sampling distribution: its logit transform divided by the temperature (TRL)."""
    scale, softcap = tempered_transform(head.logit_scale, head.softcap, temperature)
    return head.model_copy(update={"logit_scale": scale, "softcap": softcap})


def rollout_backend(model: DecoderLM, tokenizer: Tokenizer, rl: RLConfig, amp_dtype: torch.dtype | None,
                    multi_turn: bool) -> GenerationBackend:
    """`rl.backend`'s generation backend on the trainer's model (fastlm/generation/backend_config.py), kept
    across rollouts (its CUDA graphs too); with `rl.routing_replay` it records each token's experts."""
    return rl.backend.build(model, tokenizer, amp_dtype, multi_turn, record_routing=rl.routing_replay)


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
        self.setup: RolloutSetup | None = None  # what rollouts draw from (online runs; set by build_loaders)
        super().__init__(config, rank)
        # Replaces the base schedule before any step; base_lrs stay the optimizer's initial lr.
        self.scheduler = rl_scheduler(self.optimizer, config, self.rl)
        tempered = self.rl.temperature not in (0.0, 1.0) and not self.offline
        self.warmup_head = LMHead(warmup_head_config(config.model.head))
        self.policy_head = LMHead(policy_head_config(config.model.head, self.rl.temperature)) if tempered else self.model.head
        self.backend = None if self.setup is None else rollout_backend(
            self.model, self.tokenizer, self.rl, self.amp_dtype, multi_turn=self.setup.environment is not None)
        self.eval_problems: list[Problem] = []  # the built-in task's
        self.eval_records: list[PromptRecord] = []  # a prompt data set's (rl/eval_prompts.py)
        self.timing = [0.0, 0.0, 0]  # rollout seconds, train seconds, steps since the last log record
        self.rollout_seconds = 0.0  # drawing rollouts in the current step
        self.phase_seconds = dict.fromkeys(("sampling", "reward", "teacher", "old_logprob"), 0.0)  # the same, split
        self.teacher = None if self.setup is None or self.rl.teacher is None else load_teacher(
            self.rl.teacher, self.rl.temperature, self.device, self.amp_dtype, self.policy_head.logits_memory_mib)
        chosen = self.rl.eval_prompts
        if self.setup is not None and self.rl.prompts is None and isinstance(chosen, int) and chosen:
            rng = random.Random(config.run.seed + 4)
            self.eval_problems = [self.setup.task.sample(rng) for _ in range(chosen)]
        elif self.setup is not None:
            limit = config.model.max_seq_len - self.rl.max_new_tokens
            self.eval_records, line = eval_records(self.rl, self.setup.prompts, self.tokenizer, limit, config.run.seed + 4)
            if self.rank in (None, 0):
                print(line, file=sys.stderr)
        self.eval_rewards: list[tuple[int, float]] = []
        self.logged_rollout = 0  # the last rollout whose completions table was logged

    def build_loaders(self, tokenizer: Tokenizer) -> tuple[RolloutStream | PolicyBatchLoader | RankShardLoader, None]:
        self.reference = None if self._reference_after_warmup() else self._reference()
        data, seed, parallel = self.config.data, self.config.run.seed, self.parallel
        shard = RolloutShard(parallel.dp_rank, parallel.dp_size, parallel.dp_group, self.device)
        if self.offline:
            samples = load_offline_rl(self.config.data.source.path, tokenizer)
            rows = pack_policy_samples(samples, data.seq_len, tokenizer.pad_id)
            check_batch_fits(rows, None, data.micro_batch_size * shard.count)
            return rank_rows(PolicyBatchLoader(rows, data.micro_batch_size * shard.count, seed), shard), None
        self.setup = RolloutSetup.build(self.rl, self.config.model.head, tokenizer, self.config.model.max_seq_len,
                                        data.seq_len, self.config.trainer.grad_accumulation, shard)
        return RolloutStream(self.setup, data.micro_batch_size, seed, self.model.output_weight.device), None

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

    @property
    def in_warmup(self) -> bool:
        return self.step < self.rl.warmup_steps and not self.offline

    @property
    def loss_head(self) -> LMHead:
        """The warm-up head during the warm-up, the policy head after it (and offline)."""
        return self.warmup_head if self.in_warmup else self.policy_head

    def micro_batches(self) -> list[Batch]:
        """This step's batches, drawing a fresh rollout whenever the latest one is used up. With a reference,
        each policy batch gets the reference's label log-probs once: the stream serves the same batch objects
        to every update of a rollout, so once per rollout."""
        stream = self.train_loader
        if not isinstance(stream, RolloutStream):
            batches = super().micro_batches()
        else:
            batches = []
            for _ in range(self.config.trainer.grad_accumulation):
                if stream.rollout_due:
                    self.next_rollout(stream)
                batches.append(stream.next_batch())
        if self.reference is None and not self.in_warmup and self._kl_child() is not None:
            self.reference = self._reference()  # the first RL step after a warm-up
        if self.reference is not None and not self.in_warmup:
            head = self.reference.config.head
            scale, softcap = tempered_transform(head.logit_scale, head.softcap, 0.0 if self.offline else self.rl.temperature)
            for batch in batches:
                if batch.ref_logp is None:
                    batch.ref_logp = policy_logprobs(self.reference, batch, scale, softcap, self.amp_dtype,
                                                     self.policy_head.logits_memory_mib)
        if self.teacher is not None and self.teacher.config.objective == "gkd" and not self.in_warmup:
            resumed = [batch for batch in batches if batch.teacher_head is None]  # a checkpoint leaves it out
            if resumed:
                add_teacher_heads(resumed, self.teacher)
        return batches

    def next_rollout(self, stream: RolloutStream) -> None:
        """Draw a rollout of the current policy (rl/rollout.py) and serve it from this step on. A failure leaves
        the stream's prompt and sampling generators as they were."""
        assert self.setup is not None and self.backend is not None
        with stream.restored_on_failure():
            rollout = collect_rollout(self.model, self.policy_head, self.backend, self.setup, stream.prompt_rng,
                                      stream.generator, self.amp_dtype, self.teacher)
        stream.start(rollout)
        for phase, seconds in rollout.seconds.items():
            self.phase_seconds[phase] += seconds
        self.rollout_seconds += sum(rollout.seconds.values())

    def train_step(self) -> StepResult:
        """One step; its rollout and training seconds are summed for the next log record. A failing reward function
        or environment stops the run after a checkpoint of the last finished step (the stream is as before the
        rollout)."""
        started = time.perf_counter()
        self.rollout_seconds = 0.0
        try:
            result = super().train_step()
        except RewardError as error:
            path = self.save()
            raise RewardError(f"{error}; the run stopped before step {self.step + 1}, checkpoint of step {self.step} "
                              f"saved to {path}: fix it and continue with --resume") from error
        total = time.perf_counter() - started
        rollout = self.rollout_seconds
        self.timing = [self.timing[0] + rollout, self.timing[1] + total - rollout, self.timing[2] + 1]
        return result

    def eval_record(self) -> dict[str, float]:
        """The greedy eval (rl/evaluation.py: eval/reward and the task's accuracy or the reward functions'
        statistics); an RL run has no held-out loss."""
        if self.backend is None or self.setup is None or not (self.eval_problems or self.eval_records):
            return {}
        scores = greedy_eval(self.backend, self.setup, self.eval_problems, self.eval_records)
        self.eval_rewards.append((self.step, scores["eval/reward"]))
        return scores

    def log_record(self, values: StepValues, tokens_per_second: float) -> dict[str, Any]:
        record = super().log_record(values, tokens_per_second)
        warmup = self.step <= self.rl.warmup_steps and not self.offline  # the step just taken
        record["train/rl/warmup"] = float(warmup)
        rollout, train, steps = self.timing  # per-step means over the steps since the last record
        record["train/timing/rollout_seconds"] = rollout / max(steps, 1)
        record["train/timing/train_seconds"] = train / max(steps, 1)
        self.timing = [0.0, 0.0, 0]
        stream = self.train_loader
        if isinstance(stream, RolloutStream) and stream.metrics and not warmup:
            record.update({f"train/{name}": value for name, value in stream.metrics.items()})
            record["train/rl/rollouts"] = float(stream.rollouts)
            if stream.rollouts != self.logged_rollout:  # each rollout's sample completions once (a table)
                record[COMPLETIONS_KEY] = [{"rollout": stream.rollouts, **row} for row in stream.examples]
                self.logged_rollout = stream.rollouts
        return record

    def train(self, resume: bool = False) -> RLSummary:
        summary = super().train(resume)
        rewards = list(self.train_loader.rewards) if isinstance(self.train_loader, RolloutStream) else []
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
