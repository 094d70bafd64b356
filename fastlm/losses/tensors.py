"""The tensors a loss call reads and returns (targets, step-wide normalizers, the result) and the per-token
helpers every path shares (the logit transform, the label's log-prob). A leaf of fastlm/losses: the
children, kernels and checks import these without the spec (spec.py), which names the children back."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch
import torch.distributed as dist

IGNORE_INDEX = -100
ProcessGroup = dist.ProcessGroup


def safe_inverse(count: float) -> float:
    """1/count, or 0 when nothing is counted (then every sum it scales is empty anyway)."""
    return 1.0 / count if count > 0 else 0.0


@dataclass
class LossTargets:
    """Per-token tensors, flattened to (tokens,): what the children read besides the logits."""

    labels: torch.Tensor  # int64, IGNORE_INDEX (-100) masks a token
    old_logp: torch.Tensor | None = None  # policy children: log-prob of the label under the sampling policy
    advantages: torch.Tensor | None = None  # policy children: per token (GSPO: constant within a document)
    # GSPO, loss_type grpo/dr_grpo: int64; a document is a run of equal ids (adjacent documents differ)
    document_ids: torch.Tensor | None = None
    teacher_logits: torch.Tensor | None = None  # distillation: (tokens, vocab), any float dtype
    # DPO: (sequences,) summed log-probs under the frozen reference; sequences are document_ids in
    # sorted order, and sequence 2k / 2k+1 are the chosen / rejected answer of pair k
    reference_logps: torch.Tensor | None = None
    # policy children with beta > 0: (tokens,) log-prob of the label under the frozen reference model
    ref_logp: torch.Tensor | None = None
    # distillation through the chunked head: the teacher's hidden states and head weight instead of
    # teacher_logits, so the teacher's logits are computed per chunk too
    teacher_head: TeacherHead | None = None
    # per-token tensors a child derives from the whole call (`LossChild.prepare`), keyed
    # "<child>/<name>": computed once before a chunked head slices the call into chunks
    prepared: dict[str, torch.Tensor] | None = None

    def rows(self, rows: slice) -> LossTargets:
        """These targets for one chunk of tokens (per-sequence DPO reference log-probs stay whole)."""
        sliced = {
            item.name: getattr(self, item.name)[rows]
            for item in fields(self)
            if item.name not in ("reference_logps", "teacher_head", "prepared") and getattr(self, item.name) is not None
        }
        if self.teacher_head is not None:
            sliced["teacher_head"] = self.teacher_head.rows(rows)
        if self.prepared is not None:
            sliced["prepared"] = {name: tensor[rows] for name, tensor in self.prepared.items()}
        return replace(self, **sliced)


@dataclass(frozen=True)
class TeacherHead:
    """A distillation teacher's head input: its final hidden states and output weight, with its own
    logit transform, so the chunked head computes the teacher logits `transform(hidden_c @ weight.T)`
    per chunk instead of reading (tokens, vocab) teacher logits."""

    hidden: torch.Tensor  # (..., Ht): flattened to (tokens, Ht) by the batch
    weight: torch.Tensor  # (V, Ht): the full vocab, or this rank's vocab shard under tensor parallelism
    logit_scale: float = 1.0
    softcap: float | None = None

    @property
    def shape(self) -> torch.Size:
        """The token dims of the hidden states (what per-token shape checks compare)."""
        return self.hidden.shape[:-1]

    def to(self, device: torch.device | str) -> TeacherHead:
        return replace(self, hidden=self.hidden.to(device), weight=self.weight.to(device))

    def flatten(self) -> TeacherHead:
        """Hidden states as (tokens, Ht)."""
        return replace(self, hidden=self.hidden.reshape(-1, self.hidden.shape[-1]))

    def rows(self, rows: slice) -> TeacherHead:
        return replace(self, hidden=self.hidden[rows])

    def vocab_rows(self, start: int, count: int) -> TeacherHead:
        """This rank's shard of the output weight (a vocab-parallel student head)."""
        return replace(self, weight=self.weight[start : start + count])

    def logits(self, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """transform(hidden @ weight.T) as the teacher's softmax sees it (in `dtype`, default the
        hidden's; into `out` when given, the transform applied in place)."""
        dtype = dtype or self.hidden.dtype
        logits = torch.mm(self.hidden.to(dtype), self.weight.to(dtype).t(), out=out)
        if self.logit_scale != 1.0:
            logits.mul_(self.logit_scale)
        if self.softcap is not None:
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits


@dataclass(frozen=True)
class LossNormalizers:
    """Counts over the whole optimizer step (every micro-batch and data-parallel rank).

    Dividing by step-wide counts makes gradient accumulation and data parallelism give exactly the
    gradient of one big batch.
    """

    tokens: float  # unmasked labels
    documents: float = 1.0  # documents (sequences) with at least one unmasked token
    micro_batches: float = 1.0  # loss calls of the step over all ranks (loss_type bnpo averages their means)
    positions: float = 0.0  # input positions other than padding (the MoE router losses' tokens); 0: unknown, the call is the step


@dataclass
class LossResult:
    """`loss` is the weighted sum (differentiable). `losses` and `metrics` are detached and additive:
    each is this call's contribution to the step-wide mean, so micro-batches and ranks are summed."""

    loss: torch.Tensor
    losses: dict[str, torch.Tensor] = field(default_factory=dict)  # child name -> unweighted loss
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # "<child>/<metric>" -> value


def transform_logits(logits: torch.Tensor, logit_scale: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """x = s*z, or x = c*tanh(s*z/c) with a softcap: the logits every child (and the sampler) sees."""
    scaled = logits * logit_scale if logit_scale != 1.0 else logits
    if softcap is not None:
        scaled = softcap * torch.tanh(scaled / softcap)
    return scaled


def pick_labels(log_probs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(y_t) from (..., V) log-probabilities and (...) labels; 0 where a label is the ignore index."""
    picked = log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(labels != IGNORE_INDEX, picked, torch.zeros_like(picked))


def label_logp(
    logits: torch.Tensor, labels: torch.Tensor, logit_scale: float = 1.0, softcap: float | None = None
) -> torch.Tensor:
    """The label's log-prob under the head's transform, by a full log-softmax in the logits' dtype (0 on
    masked tokens): the reference, the rollout's old/reference log-probs and DPO's sums share it, so a
    first update's ratio is 1 up to the loss path's own rounding."""
    return pick_labels(torch.log_softmax(transform_logits(logits, logit_scale, softcap), dim=-1), labels)
