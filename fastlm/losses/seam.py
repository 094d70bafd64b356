"""GSPO segment seam: per-document ratio -> per-token gradient coefficient.

GSPO needs every token's new log-prob before any gradient can be written (the ratio is per
document), so both the compiled and the Triton path stop after the statistics pass, call this eager
code, and resume with a per-token coefficient that superposes with the other label-based children.

Documents are grouped by id value (ids need not be contiguous or sorted, and a row may hold several
documents); ids must therefore be unique across the flattened batch. Masked tokens belong to no
document, and a document without unmasked tokens does not exist.

Synchronisation: `torch.unique` must read its output size back from the device, and that is the one
sync the seam costs; no boolean-mask indexing (each one is a sync too). Masked tokens are mapped to a
sentinel id below every real id, prepended once so it is always unique's bin 0, which is dropped.
Masked tokens land in bin 0, so the per-document sums need no mask (and ignore NaN there).
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
    inverse, count = _document_index(document_ids, mask)
    bins = new_logp.new_zeros(count + 1, dtype=dtype)
    lengths = bins.index_add(0, inverse, mask.to(dtype))[1:]
    ratio = torch.exp(bins.index_add(0, inverse, (new_logp - old_logp).to(dtype))[1:] / lengths)
    advantage = bins.index_add(0, inverse, advantages.to(dtype))[1:] / lengths
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
    if spec.weight != 0:
        coefficient = torch.cat([bins[:1], per_document])[inverse]  # bin 0 (masked tokens) gets 0
    else:
        coefficient = new_logp.new_zeros(new_logp.shape, dtype=dtype)
    return GSPOSeam(ratio, advantage, lengths, document_loss, loss, coefficient)


def _document_index(document_ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(per-token bin: 0 for masked tokens, 1 + rank of the document id otherwise; number of present
    documents). The only device->host sync is unique's output size."""
    ids = document_ids.to(torch.int64)
    if ids.numel() == 0:
        return ids, 0
    sentinel = (ids.min() - 1).view(1)
    keys = torch.cat([sentinel, torch.where(mask, ids, sentinel)])
    uniques, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    return inverse[1:], uniques.numel() - 1
