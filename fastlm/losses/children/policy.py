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

Regularisers, per token, times the child's weight:
- `beta` (reference KL, TRL's k3), times w_t: `beta*k3(new, ref)`, coefficient `beta*(exp(ref - new) - 1)`
  in `c*(p_j - [j == y])`; `use_bias_correction_kl` (TRL) multiplies k3 by the ratio r = exp(new - old)
  (not detached): coefficient `beta*r*(expm1(ref - new) - k3)`;
- `entropy_coeff` e: `-e*H_t` times the entropy weight v_t; gradient `e*v_t*p_j*(x_j - E_p[x])`: `x` term
  e*v_t, `prob -= e*v_t*E_p[x]`. `entropy_aggregation: token_mean` (TRL 1.16's bonus, every loss_type
  alike) is the mean of H over the call's trained tokens (the selected ones with `top_entropy_quantile`
  < 1), averaged over the step's calls (TRL: the micro-batch's mean divided by the gradient-accumulation
  steps, averaged over the ranks): v_t = 1/(N_trained_call * calls), for bnpo without selection its w_t;
  `loss_type` weighs H like the policy loss (v_t = w_t).

`top_entropy_quantile` q < 1 (TRL; "the 80/20 rule", Wang et al. 2025): only the tokens whose entropy is
at least the (1 - q)-quantile of the call's unmasked tokens' entropies (linear interpolation, as
torch.quantile) keep their policy-gradient term and entropy bonus; the KL term stays on every token and
the normalisers are unchanged (TRL multiplies the per-token loss by the mask before its aggregation).

The fused Triton kernel has no slot for a call-wide quantile or the bias-corrected KL: a child with one
of them (`past_kernel`: no `slot`) runs on the Triton path as under tensor parallelism (a stats launch,
the torch tail below, a grad launch). A token-mean entropy weight that differs from w_t is a second
per-token weight row the fused launch (GSPO: its seam) reads (`KernelSlot.entropy_weights`).

Metrics (token means over the step's unmasked tokens, every loss_type): `new_logp`, `entropy`,
`kl_old` (k3 against the sampling policy), and `kl` (k3 against the frozen reference) when beta > 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field, model_validator

from fastlm.losses.children.base import ChildConfig, KernelSlot, LossChild, ReferenceInputs, Tail, TailInputs
from fastlm.losses.document_weights import launched_document_means
from fastlm.losses.frozen_model import FrozenModel
from fastlm.losses.metrics import k3_kl
from fastlm.losses.tensors import IGNORE_INDEX, LossNormalizers, LossTargets, safe_inverse

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
        None, description="Checkpoint of the frozen reference (beta > 0); None means a copy of the policy as RL "
        "starts (the initial one, or the warmed-up one after rl.warmup_steps)."
    )
    entropy_coeff: float = Field(0.0, ge=0.0, description="Entropy bonus: the loss subtracts entropy_coeff x entropy.")
    entropy_aggregation: Literal["token_mean", "loss_type"] = Field(
        "token_mean", description="token_mean (TRL 1.16): the bonus is the mean entropy over each micro-batch's "
        "trained tokens, averaged over micro-batches; loss_type: entropy weighted per token like the policy loss.",
    )
    top_entropy_quantile: float = Field(
        1.0, gt=0.0, le=1.0, description="TRL's: train the policy term (and entropy bonus) only on the share q of "
        "tokens with the highest entropy (per loss call); 1.0 = every token.",
    )
    use_bias_correction_kl: bool = Field(
        False, description="TRL's: multiply the per-token KL penalty by the importance ratio exp(new - old)."
    )

    @model_validator(mode="after")
    def _check_loss_type(self) -> PolicyConfig:
        if self.loss_type == "dr_grpo" and self.max_completion_length is None:
            raise ValueError("loss_type dr_grpo divides by max_completion_length x sequences; set max_completion_length")
        if self.use_bias_correction_kl and self.beta == 0:
            raise ValueError("use_bias_correction_kl corrects the KL penalty, which is off at beta 0; set beta > 0 "
                             "(e.g. 0.04) or remove use_bias_correction_kl")
        return self

    def frozen_model(self) -> FrozenModel | None:
        """A KL penalty's reference (beta > 0)."""
        return FrozenModel("reference", "reference_path", self.reference_path) if self.beta > 0 else None

    def first_update_slope(self) -> float:
        """d(token loss)/d(new_logp) per unit of advantage at ratio 1 (a rollout's first update) on a token the
        policy term trains: 1 for the clipped surrogate (1 lies inside its clip range)."""
        return 1.0

    def policy_numbers(self) -> dict[str, object]:
        return {"loss_type": self.loss_type, "max_completion_length": self.max_completion_length or 0,
                "beta": self.beta, "entropy_coeff": self.entropy_coeff,
                "entropy_token_mean": self.entropy_aggregation == "token_mean",
                "top_entropy_quantile": self.top_entropy_quantile, "bias_corrected_kl": self.use_bias_correction_kl}


@dataclass(frozen=True)
class PolicyChild(LossChild):
    """Fields shared by the policy children; subclasses add their ratio and clipping numbers."""

    loss_type: str = "dapo"
    max_completion_length: int = 0
    beta: float = 0.0
    entropy_coeff: float = 0.0
    entropy_token_mean: bool = True
    top_entropy_quantile: float = 1.0
    bias_corrected_kl: bool = False

    reads = POLICY_INPUTS

    @property
    def entropy_selected(self) -> bool:
        """Whether only the highest-entropy tokens train (`top_entropy_quantile` < 1)."""
        return self.top_entropy_quantile < 1.0

    @property
    def entropy_weighted_apart(self) -> bool:
        """Whether the entropy bonus's per-token weight differs from the loss_type weight w_t (token_mean
        but for bnpo, whose w_t is the same call mean)."""
        return self.entropy_coeff > 0 and self.entropy_token_mean and self.loss_type != "bnpo"

    @property
    def past_kernel(self) -> bool:
        """Whether an option is past the fused kernel's slot (then `slot` is None)."""
        return self.entropy_selected or (self.bias_corrected_kl and self.beta > 0)

    @property
    def kernel_reads(self) -> tuple[str, ...]:
        """The per-token targets the fused kernel loads for it."""
        return POLICY_INPUTS + (("ref_logp",) if self.beta > 0 else ())

    @property
    def whole_call(self) -> bool:
        return self.per_document or self.entropy_selected

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
        slices it. No sort, no sync. loss_type grpo's document pass in float32 is one launch where the
        backend has one (`document_weights.launched_document_means`, the same values bit for bit), torch
        ops otherwise; `slot` (`document_slots`, when the caller has it) saves that pass."""
        if self.loss_type == "dapo":
            return None
        sequences = safe_inverse(normalizers.documents)
        if self.loss_type == "grpo" and slot is None and dtype == torch.float32:
            launched = launched_document_means(targets.document_ids, targets.labels, sequences)
            if launched is not None:
                return launched
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

    def call_entropy_weights(self, targets: LossTargets, normalizers: LossNormalizers,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """v_t of a token-mean entropy bonus on every unmasked token (no selection): the `prepare`d ones of a
        chunked head's whole call, else the call mean here."""
        prepared = self.prepared(targets, "entropy_weights")
        if prepared is not None:
            return prepared.to(dtype)
        return call_token_mean(targets.labels != IGNORE_INDEX, normalizers, dtype)

    def prepare(self, targets: LossTargets, normalizers: LossNormalizers, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """loss_type grpo and bnpo weigh a token by counts over the whole call (its document's tokens, the
        call's tokens), as does a token-mean entropy bonus; a whole-call child's tail sees the whole call
        anyway (the chunked head's two passes)."""
        if self.whole_call:
            return {}
        prepared = {}
        if self.loss_type in ("grpo", "bnpo"):
            prepared["token_weights"] = self.token_weights(targets, normalizers, dtype)
        if self.entropy_weighted_apart:
            prepared["entropy_weights"] = call_token_mean(targets.labels != IGNORE_INDEX, normalizers, dtype)
        return prepared

    def aggregation(self, inputs: TailInputs, slot: torch.Tensor | None = None) -> torch.Tensor | float:
        weights = self.call_weights(inputs.targets, inputs.normalizers, inputs.dtype, slot)
        return inputs.per_token if weights is None else weights

    # -- shared terms --------------------------------------------------------------------------

    def selected_tokens(self, inputs: TailInputs) -> torch.Tensor | None:
        """(T,) 1.0 on the tokens that train with `top_entropy_quantile` < 1, else None."""
        if not self.entropy_selected:
            return None
        return high_entropy_tokens(inputs.entropy, inputs.mask, 1.0 - self.top_entropy_quantile).to(inputs.dtype)

    def entropy_weights(self, inputs: TailInputs, w: torch.Tensor | float,
                        selected: torch.Tensor | None) -> torch.Tensor | float:
        """v_t, the entropy bonus's per-token weight (`entropy_aggregation`), on the selected tokens."""
        if not self.entropy_token_mean:
            return w if selected is None else selected * w
        if selected is None:
            if self.loss_type == "bnpo":
                return w  # its w_t is the call mean already
            return self.call_entropy_weights(inputs.targets, inputs.normalizers, inputs.dtype)
        return call_token_mean(selected, inputs.normalizers, inputs.dtype)

    def regularizers(self, inputs: TailInputs, w: torch.Tensor | float, out: Tail,
                     selected: torch.Tensor | None = None, document_ratio: torch.Tensor | None = None) -> torch.Tensor | None:
        """(T,) beta*k3(ref)*w_t - e*H*v_t, already weighted (None without either); adds their coefficients
        to `out`. The bias-corrected KL's ratio is the token's (its derivative included here) or, given,
        GSPO's document ratio per token (the caller adds the gradient through it)."""
        extra = None
        mask = inputs.mask.to(inputs.dtype)
        if self.beta > 0:
            gap = inputs.target("ref_logp") - inputs.new_logp
            k3, slope = torch.expm1(gap) - gap, torch.expm1(gap)
            if self.bias_corrected_kl and document_ratio is not None:
                k3, slope = document_ratio * k3, document_ratio * slope
            elif self.bias_corrected_kl:
                ratio = torch.exp(inputs.new_logp - inputs.target("old_logp"))
                k3, slope = ratio * k3, ratio * (slope - k3)
            extra = self.beta * k3 * w
            if self.weight != 0:
                out.add_label_form(slope * mask * (w * self.beta * self.weight))
        if self.entropy_coeff > 0:
            v = self.entropy_weights(inputs, w, selected)
            bonus = -self.entropy_coeff * inputs.entropy * v
            extra = bonus if extra is None else extra + bonus
            if self.weight != 0:
                e = mask * (v * self.entropy_coeff * self.weight)
                out.prob -= e * (inputs.lse - inputs.entropy)  # E_p[x] = lse - H
                out.add_x_term(e)
        return extra

    def token_level_loss(self, inputs: TailInputs, out: Tail, token_loss: torch.Tensor, slope: torch.Tensor) -> None:
        """Token-level children (GRPO, CISPO): the aggregated per-token loss (on the selected tokens) plus
        regularizers, the token metrics, and `slope` (d loss / d new_logp per token) as the label-form
        coefficient."""
        w = self.aggregation(inputs)
        selected = self.selected_tokens(inputs)
        if selected is not None:
            token_loss, slope = token_loss * selected, slope * selected
        extra = self.regularizers(inputs, w, out, selected)
        if isinstance(w, float) and extra is None:
            out.loss(self.name, token_loss, w)
        else:
            out.loss(self.name, token_loss * w if extra is None else token_loss * w + extra)
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

    def reference_selected(self, inputs: ReferenceInputs) -> torch.Tensor:
        """(T,) 1.0 on the tokens that train: TRL's get_high_entropy_mask (torch.quantile of the unmasked
        tokens' entropies at 1 - q, then entropy >= it), or every unmasked token."""
        mask = inputs.mask
        if not self.entropy_selected:
            return mask.to(inputs.new_logp.dtype)
        entropy = -(inputs.log_probs.exp() * inputs.log_probs).sum(-1).detach()
        if not mask.any():
            return torch.zeros_like(entropy)
        threshold = torch.quantile(entropy[mask], 1.0 - self.top_entropy_quantile)
        return ((entropy >= threshold) & mask).to(entropy.dtype)

    def reference_regularizers(self, inputs: ReferenceInputs, weights: torch.Tensor, selected: torch.Tensor,
                               ratio: torch.Tensor | None = None) -> torch.Tensor:
        """beta * sum_t w_t k3_t (times the ratio with use_bias_correction_kl) - e * the entropy bonus,
        written from TRL 1.16's _compute_loss (the bonus, every loss type: the mean over the call's selected
        tokens divided by the step's calls), by autograd."""
        total = inputs.new_logp.new_zeros(())
        mask = inputs.mask
        if self.beta > 0:
            gap = torch.where(mask, inputs.targets.ref_logp.to(total.dtype) - inputs.new_logp, 0.0)
            k3 = torch.exp(gap) - gap - 1.0
            if self.bias_corrected_kl:
                old = torch.where(mask, inputs.targets.old_logp.to(total.dtype), 0.0)
                k3 = k3 * (torch.exp(inputs.new_logp - old) if ratio is None else ratio)
            total = total + self.beta * (k3 * weights).sum()
        if self.entropy_coeff > 0:
            entropy = torch.where(mask, -(inputs.log_probs.exp() * inputs.log_probs).sum(-1), 0.0)
            if not self.entropy_token_mean:
                bonus = (entropy * weights * selected).sum()
            else:
                bonus = (entropy * selected).sum() / selected.sum().clamp(min=1.0) / inputs.normalizers.micro_batches
            total = total - self.entropy_coeff * bonus
        return total

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

    # -- the fused kernel's slot of a token-level child (GRPO, CISPO) ---------------------------

    def token_level_slot(self, scalars: dict[str, float]) -> KernelSlot | None:
        """Its loss and metrics as rows, the shared numbers and switches (reference KL, entropy bonus)
        plus its own `scalars`; None when an option is past the kernel."""
        if self.past_kernel:
            return None
        numbers = {"weight": self.weight, "beta": self.beta, "entropy_coeff": self.entropy_coeff, **scalars}
        return KernelSlot(self.kind, ("loss", *self.metric_names()), numbers,
                          {"ref": self.beta > 0, "entropy": self.entropy_coeff > 0}, reads=self.kernel_reads,
                          token_weights=self.loss_type != "dapo", entropy_weights=self.entropy_weighted_apart,
                          entropy=True, x_term=self.entropy_coeff > 0)


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


def call_token_mean(tokens: torch.Tensor, normalizers: LossNormalizers, dtype: torch.dtype) -> torch.Tensor:
    """(T,) weights of the mean over this call's `tokens` (bool or 0/1), averaged over the step's calls."""
    tokens = tokens.to(dtype)
    return tokens / (tokens.sum().clamp(min=1.0) * normalizers.micro_batches)


def high_entropy_tokens(entropy: torch.Tensor, mask: torch.Tensor, level: float) -> torch.Tensor:
    """(T,) bool: unmasked tokens whose entropy is at least the `level`-quantile of the unmasked tokens'
    entropies (linear interpolation, as torch.quantile; none when no token is unmasked). Sort-based,
    with no device->host sync (no boolean indexing)."""
    count = mask.sum()
    ordered = torch.where(mask, entropy, torch.inf).sort().values  # the unmasked ones first
    position = (count - 1).clamp(min=0).to(entropy.dtype) * level
    low, high = position.floor().long(), position.ceil().long()
    threshold = torch.lerp(ordered[low], ordered[high], position - low.to(entropy.dtype))
    return mask & (entropy >= threshold)

