"""What the policy children (GRPO, GSPO, CISPO) share: options named like TRL's GRPOConfig, the
per-token aggregation weight of `loss_type`, the reference-KL and entropy terms, the token metrics.

Aggregation (`loss_type`) is a per-token weight w_t on the token loss and on its coefficient:
- `dapo`: w_t = 1/N_step (unmasked tokens of the optimizer step; one big batch under accumulation);
- `grpo`: w_t = 1/(|i| * S_step) for token t of sequence i (sequence mean, then mean over sequences);
- `bnpo`: w_t = 1/(N_call * calls), the mean over this call's tokens, averaged over the step's loss
  calls (`normalizers.micro_batches`; accumulation then no longer equals one big batch, by definition);
- `dr_grpo`: w_t = 1/(L_max * S_step), L_max = `max_completion_length`.
`|i|` counts the unmasked tokens of document i in this call (a document never spans two calls). A
document is a run of equal ids in the flattened batch (`document_slots`): packing keeps each
document's tokens contiguous, masked tokens (its prompt, say) included, and two adjacent documents
never share an id (the pipeline numbers them across the whole batch); an id seen again further on
is another document.

Regularisers, per token, both times w_t and the child's weight:
- `beta` (reference KL, TRL's k3): `beta*k3(new, ref)`, coefficient `beta*(exp(ref - new) - 1)` in
  `c*(p_j - [j == y])`;
- `entropy_coeff` e: `-e*H_t`; gradient `e*p_j*(x_j - E_p[x])`: `x` term e, `prob -= e*E_p[x]`.

Metrics (token means over the step's unmasked tokens, every loss_type): `new_logp`, `entropy`,
`kl_old` (k3 against the sampling policy), and `kl` (k3 against the frozen reference) when beta > 0.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field, model_validator

from fastlm.losses.children.base import ChildConfig, LossChild, ReferenceInputs, Tail, TailInputs, metric_key
from fastlm.losses.metrics import k3_kl
from fastlm.losses.spec import IGNORE_INDEX, LossNormalizers, LossTargets, safe_inverse

LossType = Literal["dapo", "grpo", "bnpo", "dr_grpo"]
POLICY_INPUTS = ("old_logp", "advantages")


class PolicyConfig(ChildConfig):
    loss_type: LossType = Field(
        "dapo",
        description="dapo: token mean over the step; grpo: sequence mean, then mean over sequences; "
        "bnpo: token mean over each micro-batch; dr_grpo: sum over tokens / (max_completion_length x sequences).",
    )
    max_completion_length: int | None = Field(
        None, ge=1, description="dr_grpo's constant normaliser L_max (TRL's max_completion_length)."
    )
    beta: float = Field(0.0, ge=0.0, description="KL penalty to the frozen reference model (k3); 0 = no reference model.")
    reference_path: str | None = Field(
        None, description="Checkpoint of the frozen reference (beta > 0); None means a copy of the initial policy."
    )
    entropy_coeff: float = Field(0.0, ge=0.0, description="Entropy bonus: the loss subtracts entropy_coeff x entropy.")

    @model_validator(mode="after")
    def _check_loss_type(self) -> "PolicyConfig":
        if self.loss_type == "dr_grpo" and self.max_completion_length is None:
            raise ValueError("loss_type dr_grpo divides by max_completion_length x sequences; set max_completion_length")
        return self

    def policy_numbers(self) -> dict[str, object]:
        return {"loss_type": self.loss_type, "max_completion_length": self.max_completion_length or 0,
                "beta": self.beta, "entropy_coeff": self.entropy_coeff}


@dataclass(frozen=True)
class PolicyChild(LossChild):
    """Fields shared by the policy children; subclasses add their ratio and clipping numbers."""

    loss_type: str = "dapo"
    max_completion_length: int = 0
    beta: float = 0.0
    entropy_coeff: float = 0.0

    reads = POLICY_INPUTS

    @property
    def target_names(self) -> tuple[str, ...]:
        return POLICY_INPUTS + (("ref_logp",) if self.beta > 0 else ()) + (
            ("document_ids",) if self.loss_type in ("grpo", "dr_grpo") or self.per_document else ())

    def check_targets(self, targets: LossTargets, tokens: int) -> None:
        for name in self.target_names:
            tensor = getattr(targets, name)
            if tensor is None:
                raise ValueError(f"targets.{name} is required by {self.kind} loss '{self.name}' but is None")
            if tensor.shape != (tokens,):
                raise ValueError(f"targets.{name} must have shape ({tokens},) like the labels, got {tuple(tensor.shape)}")
            if name == "document_ids" and tensor.is_floating_point():
                raise ValueError(f"targets.document_ids must be an integer tensor, got {tensor.dtype}")
            if name != "document_ids" and not tensor.is_floating_point():
                raise ValueError(f"targets.{name} must be a float tensor, got {tensor.dtype}")

    def check_normalizers(self, normalizers: LossNormalizers) -> None:
        if self.loss_type in ("grpo", "dr_grpo") and normalizers.documents <= 0:
            raise ValueError(
                f"normalizers.documents must be > 0 for {self.kind} loss_type {self.loss_type}, got {normalizers.documents}"
            )

    def token_metric_names(self) -> tuple[str, ...]:
        return ("new_logp", "entropy", "kl_old") + (("kl",) if self.beta > 0 else ())

    # -- aggregation ---------------------------------------------------------------------------

    def token_weights(
        self, targets: LossTargets, normalizers: LossNormalizers, dtype: torch.dtype = torch.float32,
        slot: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """w_t of `loss_type` for every token of the call as a (T,) vector (0 on masked tokens), or
        None for dapo (the scalar 1/N): computed once per call, so a caller that works in token chunks
        slices it. No sort, no sync. loss_type grpo's document pass is one Triton launch on CUDA in
        float32 (`triton/documents.py`, the same values bit for bit), torch ops otherwise; `slot`
        (`document_slots`, when the caller has it) saves that pass."""
        if self.loss_type == "dapo":
            return None
        sequences = safe_inverse(normalizers.documents)
        if self.loss_type == "grpo" and slot is None and dtype == torch.float32 and _document_kernel(targets.labels):
            from fastlm.losses.triton.documents import document_mean_weights

            return document_mean_weights(targets.document_ids, targets.labels, sequences)
        mask = targets.labels != IGNORE_INDEX
        weights = mask.to(dtype)
        if self.loss_type == "bnpo":
            return weights / (weights.sum().clamp(min=1.0) * normalizers.micro_batches)
        if self.loss_type == "dr_grpo":
            return weights * (sequences / self.max_completion_length)
        slot = document_slots(targets.document_ids, mask) if slot is None else slot
        lengths = weights.new_zeros(slot.numel() + 1).index_add_(0, slot, weights)
        return weights * sequences / lengths[slot].clamp(min=1.0)

    def document_weights(self, lengths: torch.Tensor, present: torch.Tensor, mask: torch.Tensor,
                         normalizers: LossNormalizers) -> torch.Tensor:
        """W_i = sum of w_t over document i's tokens, from its token count |i| (`lengths`)."""
        if self.loss_type == "grpo":
            return present.to(lengths.dtype) * safe_inverse(normalizers.documents)  # a bool times a float is float32
        if self.loss_type == "dapo":
            return lengths * safe_inverse(normalizers.tokens)
        if self.loss_type == "bnpo":
            return lengths / (mask.sum().clamp(min=1) * normalizers.micro_batches)
        return lengths * (safe_inverse(normalizers.documents) / self.max_completion_length)

    def call_weights(
        self, targets: LossTargets, normalizers: LossNormalizers,
        dtype: torch.dtype = torch.float32, slot: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """`token_weights` of this call: the `prepare`d ones of a chunked head's whole call, else computed here."""
        prepared = self.prepared(targets, "token_weights")
        if prepared is not None:
            return prepared.to(dtype)
        return self.token_weights(targets, normalizers, dtype, slot)

    def prepare(self, targets: LossTargets, normalizers: LossNormalizers, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """loss_type grpo and bnpo weigh a token by counts over the whole call (its document's tokens, the
        call's tokens); a per-document child's tail sees the whole call anyway (the chunked head's two passes)."""
        if self.per_document or self.loss_type not in ("grpo", "bnpo"):
            return {}
        return {"token_weights": self.token_weights(targets, normalizers, dtype)}

    def aggregation(self, inputs: TailInputs, slot: torch.Tensor | None = None) -> torch.Tensor | float:
        weights = self.call_weights(inputs.targets, inputs.normalizers, inputs.dtype, slot)
        return inputs.per_token if weights is None else weights

    # -- shared terms --------------------------------------------------------------------------

    def regularizers(self, inputs: TailInputs, w: torch.Tensor | float, out: Tail) -> torch.Tensor | None:
        """beta*k3(ref) - e*H per token (unscaled; None without either); adds their coefficients to `out`."""
        extra = None
        if self.beta > 0:
            gap = inputs.target("ref_logp") - inputs.new_logp
            extra = self.beta * (torch.expm1(gap) - gap)
            if self.weight != 0:
                out.add_label_form(torch.expm1(gap) * inputs.mask * (w * self.beta * self.weight))
        if self.entropy_coeff > 0:
            bonus = -self.entropy_coeff * inputs.entropy
            extra = bonus if extra is None else extra + bonus
            if self.weight != 0:
                e = inputs.mask.to(inputs.dtype) * (w * self.entropy_coeff * self.weight)
                out.prob -= e * (inputs.lse - inputs.entropy)  # E_p[x] = lse - H
                out.add_x_term(e)
        return extra

    def token_level_loss(self, inputs: TailInputs, out: Tail, token_loss: torch.Tensor, slope: torch.Tensor) -> None:
        """Token-level children (GRPO, CISPO): the aggregated per-token loss plus regularizers, the token
        metrics, and `slope` (d loss / d new_logp per token) as the label-form coefficient."""
        w = self.aggregation(inputs)
        extra = self.regularizers(inputs, w, out)
        token_loss = token_loss if extra is None else token_loss + extra
        if isinstance(w, float):
            out.loss(self.name, token_loss, w)
        else:
            out.loss(self.name, token_loss * w)
        self.token_metrics(inputs, out)
        if self.weight != 0:
            out.add_label_form(slope * (w * self.weight))

    def token_metrics(self, inputs: TailInputs, out: Tail) -> None:
        new_logp, old_logp = inputs.new_logp, inputs.target("old_logp")
        values = [new_logp, inputs.entropy, k3_kl(new_logp, old_logp)]
        if self.beta > 0:
            values.append(k3_kl(new_logp, inputs.target("ref_logp")))
        for metric, value in zip(self.token_metric_names(), values, strict=True):
            out.metric(self.name, metric, value, inputs.per_token)

    def reference_regularizers(self, inputs: ReferenceInputs) -> torch.Tensor:
        """(T,) beta*k3(ref) - e*H by autograd (0 when neither is set)."""
        extra = torch.zeros_like(inputs.new_logp)
        if self.beta > 0:
            gap = inputs.targets.ref_logp.to(extra.dtype) - inputs.new_logp
            extra = extra + self.beta * (torch.exp(gap) - gap - 1.0)
        if self.entropy_coeff > 0:
            entropy = -(inputs.log_probs.exp() * inputs.log_probs).sum(-1)
            extra = extra - self.entropy_coeff * entropy
        return torch.where(inputs.mask, extra, torch.zeros_like(extra))

    def reference_weights(self, inputs: ReferenceInputs) -> torch.Tensor:
        """w_t by a plain loop over documents (independent of `token_weights`)."""
        mask, normalizers = inputs.mask, inputs.normalizers
        ones = mask.to(inputs.new_logp.dtype)
        if self.loss_type == "dapo":
            return ones * safe_inverse(normalizers.tokens)
        if self.loss_type == "bnpo":
            return ones / (max(int(mask.sum()), 1) * normalizers.micro_batches)
        if self.loss_type == "dr_grpo":
            return ones / (self.max_completion_length * normalizers.documents)
        weights = torch.zeros_like(ones)
        for tokens in reference_documents(inputs.targets.document_ids, mask):
            weights[tokens] = 1.0 / (int(tokens.sum()) * normalizers.documents)
        return weights

    # -- the fused kernel's policy slot (GRPO, CISPO) ------------------------------------------

    def policy_kernel_arguments(self, prefix: str, row: int) -> dict:
        return {
            f"ROW_{prefix.upper()}": row,
            f"{prefix}_weight": float(self.weight),
            f"{prefix}_beta": float(self.beta),
            f"{prefix}_entropy": float(self.entropy_coeff),
            f"{prefix.upper()}_TOKEN_WEIGHTS": self.loss_type != "dapo",
            f"{prefix.upper()}_REF": int(self.beta > 0),
            f"{prefix.upper()}_ENTROPY": self.entropy_coeff > 0,
        }

    def policy_kernel_tensors(self, prefix: str, targets: LossTargets, normalizers: LossNormalizers) -> dict:
        """The per-token weights w_t of a loss_type other than dapo (dapo: the scalar token_scale)."""
        if self.loss_type == "dapo":
            return {}
        return {f"{prefix}_token_weights_ptr": self.call_weights(targets, normalizers).contiguous()}

    def kernel_x_term(self) -> bool:
        return self.entropy_coeff > 0

    @staticmethod
    def policy_kernel_absent(prefix: str) -> dict:
        return {f"ROW_{prefix.upper()}": -1, f"{prefix}_weight": 0.0, f"{prefix}_beta": 0.0, f"{prefix}_entropy": 0.0,
                f"{prefix}_token_weights_ptr": None, f"{prefix.upper()}_TOKEN_WEIGHTS": False,
                f"{prefix.upper()}_REF": 0, f"{prefix.upper()}_ENTROPY": False}

    def fused_metric_keys(self, names: tuple[str, ...]) -> tuple[tuple[bool, str], ...]:
        return ((True, self.name),) + tuple((False, metric_key(self.name, name)) for name in names)


def dual_clip(delta: float | None) -> float:
    """`delta` (None = off) as the bound the ratio is capped at in the unclipped term."""
    return math.inf if delta is None else delta


def document_slots(document_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token slot: 0 for masked tokens, else the number of its document (1, 2, ... in token
    order; a document is a run of equal ids, masked tokens included). Three elementwise launches and
    a cumulative sum: no sort, no device->host sync. Per-document vectors have T + 1 slots; slots of
    documents without an unmasked token hold zeros."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[1:] = document_ids[1:] != document_ids[:-1]
    return torch.where(mask, starts.cumsum(0), 0)


def reference_documents(document_ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """The float64 reference's documents: a token mask per run of equal ids with an unmasked token,
    found by a plain loop over the tokens (independent of `document_slots`)."""
    documents: list[torch.Tensor] = []
    ids = document_ids.tolist()
    for t, document in enumerate(ids):
        if t == 0 or document != ids[t - 1]:
            documents.append(torch.zeros_like(mask))
        documents[-1][t] = True
    return [tokens & mask for tokens in documents if (tokens & mask).any()]


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _document_kernel(labels: torch.Tensor) -> bool:
    """Whether `token_weights` runs its document pass as one Triton launch (CUDA tensors)."""
    return labels.is_cuda and _triton_importable()
