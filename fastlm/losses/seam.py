"""GSPO segment seam: per-document ratio -> per-token gradient coefficient.

GSPO needs every token's new log-prob before any gradient can be written (the ratio is per
document), so both the compiled and the Triton path stop after the statistics pass, call this eager
code, and resume with a per-token coefficient that superposes with the other label-based children.

Documents are grouped by id value (ids need not be contiguous or sorted, and a row may hold several
documents); ids must therefore be unique across the flattened batch. Masked tokens belong to no
document, and a document without unmasked tokens does not exist.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastlm.losses.spec import GSPOSpec, LossNormalizers


@dataclass
class GSPOSeam:
    """Per-document quantities (index i over present documents) and the per-token coefficient."""

    ratio: torch.Tensor  # (D,) s_i = exp(mean_{t in i}(new_logp - old_logp))
    advantage: torch.Tensor  # (D,) A_i: mean advantage over the document's unmasked tokens
    lengths: torch.Tensor  # (D,) unmasked tokens per document
    document_loss: torch.Tensor  # (D,) -min(s_i*A_i, clip(s_i)*A_i)
    loss: torch.Tensor  # scalar, unweighted: this call's share of the step-wide loss
    coefficient: torch.Tensor  # (T,) c_t with weight and normaliser; 0 on masked tokens and when weight is 0


def safe_inverse(count: float) -> float:
    """1/count, or 0 when nothing is counted (then every sum it scales is empty anyway)."""
    return 1.0 / count if count > 0 else 0.0


def gspo_seam(
    new_logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    document_ids: torch.Tensor,
    mask: torch.Tensor,
    spec: GSPOSpec,
    normalizers: LossNormalizers,
) -> GSPOSeam:
    """sequence_mean: loss = sum_i loss_i / documents, c_t = w*s_i*A_i/|i|/documents (unclipped active);
    length_proportional: loss = sum_i |i|*loss_i / tokens, c_t = w*s_i*A_i/tokens (|i| cancels)."""
    dtype = torch.promote_types(new_logp.dtype, torch.float32)
    _, inverse = torch.unique(document_ids[mask], return_inverse=True)
    count = int(inverse.max()) + 1 if inverse.numel() else 0
    zeros = new_logp.new_zeros(count, dtype=dtype)
    delta = (new_logp[mask] - old_logp[mask]).to(dtype)
    lengths = zeros.index_add(0, inverse, torch.ones_like(delta))
    ratio = torch.exp(zeros.index_add(0, inverse, delta) / lengths)
    advantage = zeros.index_add(0, inverse, advantages[mask].to(dtype)) / lengths
    clipped = ratio.clamp(1.0 - spec.eps_low, 1.0 + spec.eps_high)
    document_loss = -torch.minimum(ratio * advantage, clipped * advantage)
    # The unclipped term is the active min (and carries the gradient) exactly where:
    active = torch.where(advantage >= 0, ratio <= 1.0 + spec.eps_high, ratio >= 1.0 - spec.eps_low)
    slope = ratio * advantage * active
    if spec.length_proportional:
        scale = safe_inverse(normalizers.tokens)
        loss = (document_loss * lengths).sum() * scale
        per_document = slope * (spec.weight * scale)
    else:
        scale = safe_inverse(normalizers.documents)
        loss = document_loss.sum() * scale
        per_document = slope / lengths * (spec.weight * scale)
    coefficient = new_logp.new_zeros(new_logp.shape, dtype=dtype)
    if spec.weight != 0:
        coefficient[mask] = per_document[inverse]
    return GSPOSeam(ratio, advantage, lengths, document_loss, loss, coefficient)
