"""On-policy distillation: the student samples, a frozen teacher scores every sampled token (`rl.teacher`).

Per completion token y_t, with the sampler's log-prob s_t = log p_student(y_t) and the teacher's
u_t = log p_teacher(y_t) under the same temperature, r_t = u_t - s_t is minus the sampled estimate of the
reverse KL(student || teacher) at t. It joins the advantage the policy-gradient child trains on:

    A_t = reward_weight * A_group + coef * sum_{k >= 0} discount^k r_{t+k}

(the sum runs over the same completion's following policy tokens). reward_weight 0 and discount 0 is Thinking
Machines' on-policy distillation (the per-token reverse KL as the advantage); reward_weight > 0 mixes RL and
distillation in one run. The teacher is any model fastlm loads (a fastlm run, a Hugging Face folder, a hub
name from the cache) with the run's tokenizer, frozen, in bf16 on CUDA, and scores the rollout's packed rows
over token chunks within the head's logits budget (no full logits), as the KL reference does.

`objective: gkd` (GKD on student samples, Agarwal et al. 2024) instead gives each packed batch the teacher's head
input (`add_teacher_heads`), and the head's distillation child (e.g. kl: jsd with beta) trains on the teacher's
whole distribution at every sampled position, its logits made chunk by chunk inside the head.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from fastlm.config.errors import ConfigError, ConfigIssue
from fastlm.data.batch import Batch
from fastlm.data.tokenizer import Tokenizer, build_tokenizer
from fastlm.engine.frozen import freeze, load_frozen_model
from fastlm.engine.init_path import checkpoint_tokenizer, resolve_init_path
from fastlm.losses.spec import IGNORE_INDEX, TeacherHead
from fastlm.models.decoder import DecoderLM
from fastlm.rl.config import TeacherConfig
from fastlm.rl.consistency import tempered_transform
from fastlm.rl.packing import hidden_logprobs, policy_logprobs
from fastlm.system.device import autocast

if TYPE_CHECKING:
    from fastlm.run_config.schema import RunConfig

FIELD = "rl.teacher.path"


@dataclass
class Teacher:
    """The frozen teacher and how it scores: its own head's transform at the rollout's temperature."""

    model: DecoderLM
    config: TeacherConfig
    logit_scale: float
    softcap: float | None
    amp_dtype: torch.dtype | None
    budget_mib: float

    def score(self, batch: Batch) -> torch.Tensor:
        """(B, S) teacher log-probs of the batch's labels (0 where masked)."""
        return policy_logprobs(self.model, batch, self.logit_scale, self.softcap, self.amp_dtype, self.budget_mib)


def _resolved(path: str) -> tuple[str, str]:
    """(kind, local folder) of the teacher's path, with run.init_path's resolution and errors at rl.teacher.path."""
    try:
        source = resolve_init_path(path)
    except ConfigError as error:
        raise ConfigError([replace(issue, path=FIELD) for issue in error.issues]) from None
    return source.kind, str(source.path)


def load_teacher(config: TeacherConfig, temperature: float, device: torch.device, amp_dtype: torch.dtype | None,
                 budget_mib: float) -> Teacher:
    """The frozen teacher on `device` (bf16 on CUDA: it is only ever read)."""
    kind, path = _resolved(config.path)
    if kind == "hf":
        from fastlm.models.hf import import_hf

        model = freeze(import_hf(path, device))
    else:
        model = load_frozen_model(path, FIELD, device)
    if device.type == "cuda":
        model.to(torch.bfloat16)
    head = model.config.head
    scale, softcap = tempered_transform(head.logit_scale, head.softcap, temperature)
    return Teacher(model, config, scale, softcap, amp_dtype, budget_mib)


def teacher_tokenizer(path: str) -> Tokenizer:
    """The tokenizer the teacher was trained with: a fastlm run's, or the one saved in a Hugging Face folder."""
    kind, folder = _resolved(path)
    if kind == "hf":
        return build_tokenizer(None, folder)
    from pathlib import Path

    return build_tokenizer(checkpoint_tokenizer(Path(folder)), None)


def teacher_issues(config: RunConfig, tokenizer: Tokenizer) -> list[ConfigIssue]:
    """The start's check of `rl.teacher`: it resolves, and its tokenizer is the run's (same ids for the same text:
    its log-probs are of the student's own tokens)."""
    teacher = config.rl.teacher if config.rl is not None else None
    if teacher is None:
        return []
    try:
        theirs = teacher_tokenizer(teacher.path)
    except ConfigError as error:
        return error.issues
    if theirs.fingerprint != tokenizer.fingerprint:
        return [ConfigIssue(FIELD, f"the teacher's tokenizer ({theirs.name}) is not this run's ({tokenizer.name}): its "
                            "log-probs would be of other tokens", teacher.path,
                            hint="distill from a teacher trained with the same tokenizer (data.tokenizer)")]
    return []


def add_teacher_advantages(batches: list[Batch], teacher: Teacher) -> torch.Tensor:
    """Each batch's advantages with the teacher's term (module docstring), from its sampler log-probs (old_logp as
    packed); returns per-batch sums (reverse KL, teacher log-prob, student log-prob, tokens) for the metrics."""
    config = teacher.config
    statistics = []
    for batch in batches:
        assert batch.old_logp is not None and batch.advantages is not None
        student = batch.old_logp
        scored = teacher.score(batch)
        tokens = batch.labels != IGNORE_INDEX
        gain = (scored - student).masked_fill(~tokens, 0.0)
        term = discounted(gain, tokens, batch.document_ids, config.discount)
        batch.advantages = (config.reward_weight * batch.advantages + config.coef * term).masked_fill(~tokens, 0.0)
        statistics.append(_score_sums(scored, student, tokens))
    return torch.stack(statistics)


def add_gkd_inputs(batches: list[Batch], teacher: Teacher) -> torch.Tensor:
    """objective gkd, once per rollout: the advantages keep reward_weight * A_group, and each batch gets the
    teacher's head input (`add_teacher_heads`); returns the metric sums."""
    for batch in batches:
        assert batch.advantages is not None
        batch.advantages = teacher.config.reward_weight * batch.advantages
    return add_teacher_heads(batches, teacher)


def add_teacher_heads(batches: list[Batch], teacher: Teacher) -> torch.Tensor:
    """Each batch's teacher head input (its hidden states over the packed rows, its output weight, its head
    transform at the rollout's temperature like `score`), once per rollout like the reference log-probs (and again
    for a resumed rollout: checkpoints leave it out), for the head's distillation child. The hidden states stay where
    the batch is (the host: the device holds one micro-batch's at a time); the chunked head makes the logits per chunk.
    The same hidden states give the teacher's log-probs of the sampled tokens (its head over token chunks, no second
    forward): the per-batch sums of `add_teacher_advantages` for the train/distill/* metrics."""
    device = teacher.model.output_weight.device
    statistics = []
    for batch in batches:
        assert batch.old_logp is not None
        with torch.no_grad(), autocast(device, teacher.amp_dtype):
            hidden = teacher.model.hidden_states(batch.input_ids.to(device), batch.document_ids.to(device))
        with torch.no_grad():
            scored = hidden_logprobs(teacher.model, hidden, batch.labels, teacher.logit_scale, teacher.softcap,
                                     teacher.amp_dtype, teacher.budget_mib)
        batch.teacher_head = TeacherHead(hidden.to(batch.input_ids.device), teacher.model.output_weight,
                                         teacher.logit_scale, teacher.softcap)
        statistics.append(_score_sums(scored, batch.old_logp, batch.labels != IGNORE_INDEX))
    return torch.stack(statistics)


def _score_sums(scored: torch.Tensor, student: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(sampled reverse KL, teacher log-prob, student log-prob, tokens) summed over a batch's policy tokens."""
    gain = (scored - student).masked_fill(~tokens, 0.0)
    return torch.stack([(-gain).sum(), scored[tokens].sum(), student[tokens].sum(), tokens.sum().to(gain.dtype)]).double()


def discounted(gain: torch.Tensor, tokens: torch.Tensor, documents: torch.Tensor, discount: float) -> torch.Tensor:
    """sum_{k >= 0} discount^k gain_{t+k} over each row's later policy tokens of the same document; positions that
    are not policy tokens (prompts, an environment's replies) pass the sum on without a discount step."""
    if discount == 0.0:
        return gain
    result = torch.zeros_like(gain)
    carry = torch.zeros_like(gain[:, 0])
    for t in range(gain.shape[1] - 1, -1, -1):
        if t + 1 < gain.shape[1]:
            carry = carry * (documents[:, t] == documents[:, t + 1])
        carry = torch.where(tokens[:, t], gain[:, t] + discount * carry, carry)
        result[:, t] = carry
    return result


def teacher_metrics(sums: torch.Tensor) -> dict[str, float]:
    """distill/* of the global rollout from the per-batch sums (every rank's, gathered)."""
    reverse_kl, teacher, student, tokens = sums.sum(0).tolist()
    tokens = max(tokens, 1.0)
    return {"distill/reverse_kl": reverse_kl / tokens, "distill/teacher_logp": teacher / tokens,
            "distill/student_logp": student / tokens, "distill/logp_gap": (teacher - student) / tokens}
