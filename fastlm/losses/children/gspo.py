"""GSPO: the clipped surrogate on a per-document ratio s_i = exp(mean_{t in i}(new_t - old_t)).

GSPO needs every token's new log-prob before any coefficient (the ratio is per document), so both
the compiled and the Triton path stop after the statistics pass and run this child's tail (the
"seam"), then write the gradient with a per-token coefficient that superposes with the others. The
compiled and tensor-parallel paths run `tail` (torch); the fused Triton path runs the same formulas
as one launch on the fused launch's term buffer (its seam, triton/documents.py).

With W_i = sum_{t in i} w_t (the loss_type weights of its tokens): loss = sum_i W_i * loss_i (+ the
per-token regularisers), and token t of document i gets `c_t = W_i * s_i * A_i / |i|` where the
unclipped term is active (`delta` caps s in it, as for GRPO). `loss_type: grpo` (the default, the
GSPO paper's sequence mean) gives W_i = 1/S; `dapo` gives |i|/N (every token carries its document's
loss: the former `length_proportional`).

A document is a run of equal ids in the flattened batch (ids need not be sorted, and a row may hold
several documents; packing keeps each document contiguous and adjacent documents apart by id:
`policy.document_slots`). Masked tokens count for no document, and a document without unmasked
tokens does not exist. No sort and no device->host sync: the per-document vectors have T + 1 slots,
empty ones hold exact zeros.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field

from fastlm.losses.children.base import KernelSlot, ReferenceInputs, Tail, TailInputs
from fastlm.losses.children.grpo import RATIO_METRICS, ClippedPolicyConfig, clipped_surrogate
from fastlm.losses.children.policy import LossType, PolicyChild, document_slots, dual_clip, reference_documents
from fastlm.losses.metrics import clip_fractions
from fastlm.losses.tensors import safe_inverse


class GSPOConfig(ClippedPolicyConfig):
    type: Literal["gspo"] = "gspo"
    eps_low: float = Field(3e-4, gt=0.0, lt=1.0)
    eps_high: float = Field(4e-4, gt=0.0)
    loss_type: LossType = Field(
        "grpo",
        description="grpo (default, the GSPO paper): each document's loss once, mean over documents; dapo: every "
        "token carries its document's loss, mean over tokens; bnpo, dr_grpo as for the grpo child.",
    )

    def to_child(self, name: str) -> GSPO:
        return GSPO(name, self.weight, **self.policy_numbers(), eps_low=self.eps_low, eps_high=self.eps_high,
                    delta=dual_clip(self.delta))


@dataclass(frozen=True)
class GSPO(PolicyChild):
    eps_low: float = 3e-4
    eps_high: float = 4e-4
    delta: float = float("inf")
    loss_type: str = "grpo"

    kind = "gspo"
    reads = ("old_logp", "advantages", "document_ids")
    per_document = True

    def metric_names(self) -> tuple[str, ...]:
        return self.token_metric_names() + RATIO_METRICS + ("num_documents",)

    def tail(self, inputs: TailInputs, out: Tail) -> None:
        mask, dtype = inputs.mask, inputs.dtype
        slot = document_slots(inputs.targets.document_ids, mask)
        per_token = torch.stack([mask.to(dtype), inputs.new_logp - inputs.target("old_logp"), inputs.target("advantages")],
                                dim=1)
        sums = per_token.new_zeros((slot.numel() + 1, 3)).index_add_(0, slot, per_token)
        lengths = sums[:, 0]
        present = lengths > 0
        selected = self.selected_tokens(inputs)
        w = self.aggregation(inputs, slot) if self.beta > 0 or self.entropy_coeff > 0 or selected is not None else None
        if selected is None:
            document_w = self.document_weights(lengths, present, mask, inputs.normalizers)
        else:  # W_i over the document's selected tokens only
            document_w = per_token.new_zeros(slot.numel() + 1).index_add_(0, slot, selected * w)
        divisor = lengths.clamp(min=1.0)  # empty slots divide zeros by 1
        ratio = torch.where(present, torch.exp(sums[:, 1] / divisor), 0.0)
        advantage = sums[:, 2] / divisor
        document_loss, slope = clipped_surrogate(ratio, advantage, self.eps_low, self.eps_high, self.delta)
        document_terms = document_loss * document_w
        extra = None
        if self.beta > 0 or self.entropy_coeff > 0:  # per-token terms: need w_t itself
            extra = self.regularizers(inputs, w, out, selected, ratio[slot] if self.bias_corrected_kl else None)
            if self.bias_corrected_kl and self.weight != 0:  # beta*K_i*s_i, K_i = sum_i w_t k3_t: through s_i
                gap = inputs.target("ref_logp") - inputs.new_logp
                kl = per_token.new_zeros(slot.numel() + 1).index_add_(0, slot, (torch.expm1(gap) - gap) * w * mask)
                out.add_label_form((-self.beta * self.weight * kl * ratio / divisor)[slot] * mask)
        out.loss(self.name, document_terms if extra is None else torch.cat([document_terms, extra]))
        self.token_metrics(inputs, out)
        low, high, region = clip_fractions(ratio, advantage, 1.0 - self.eps_low, 1.0 + self.eps_high)
        per_document = safe_inverse(inputs.normalizers.documents)
        for metric, value in zip(RATIO_METRICS, (ratio, advantage, low, high, region), strict=True):
            out.metric(self.name, metric, value, per_document)
        out.metric(self.name, "num_documents", present, 1.0)
        if self.weight != 0:
            out.add_label_form((slope * (document_w / divisor) * self.weight)[slot])  # slot 0 (masked): 0

    def reference(self, inputs: ReferenceInputs) -> torch.Tensor:
        mask, targets = inputs.mask, inputs.targets
        weights, selected = self.reference_weights(inputs), self.reference_selected(inputs)
        total = inputs.new_logp.new_zeros(())
        ratios = torch.zeros_like(inputs.new_logp)  # each token's document ratio (TRL's sequence-level coef_1)
        for tokens in reference_documents(targets.document_ids, mask):
            delta = inputs.new_logp[tokens] - targets.old_logp[tokens].to(inputs.new_logp.dtype)
            ratio = torch.exp(delta.mean())
            ratios = torch.where(tokens, ratio, ratios)
            advantage = targets.advantages[tokens].to(inputs.new_logp.dtype).mean()
            clipped = ratio.clamp(1.0 - self.eps_low, 1.0 + self.eps_high)
            capped = ratio.clamp(max=self.delta)
            loss = -torch.min(capped * advantage, clipped * advantage)
            total = total + loss * (weights[tokens] * selected[tokens]).sum()
        return total + self.reference_regularizers(inputs, weights, selected, ratios)

    def slot(self) -> KernelSlot | None:
        """The token metrics (the fused launch writes them), then the loss and the document metrics (its
        seam, triton/documents.py, writes them after that launch, and adds its coefficients)."""
        if self.past_kernel:
            return None
        rows = (*self.token_metric_names(), "loss", *RATIO_METRICS, "num_documents")
        return KernelSlot(self.kind, rows, switches={"ref": self.beta > 0}, reads=self.kernel_reads, entropy=True,
                          x_term=self.entropy_coeff > 0)



