"""GSPO segment seam: per-document ratio -> per-token gradient coefficient.

GSPO needs every token's new log-prob before any gradient can be written (the ratio is per
document), so both the compiled and the Triton path stop after the statistics pass, call this eager
code, and resume with a per-token coefficient that superposes with the other label-based children.

Documents are grouped by id value (ids need not be contiguous or sorted, and a row may hold several
documents); ids must therefore be unique across the flattened batch. Masked tokens belong to no
document, and a document without unmasked tokens does not exist.

No device->host sync: a batch of T tokens holds at most T documents, so the per-document vectors
have T + 2 slots (slot 0 for masked tokens, then the documents in id order, then empty slots) and
`present` marks the real ones; a sort and a cumulative sum rank the ids, so the host never waits for
a count (as `torch.unique` would) and can queue the gradient launch while the GPU works. Empty
slots and slot 0 hold exact zeros in every per-document vector, so sums over all slots are sums
over the present documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastlm.losses.spec import GSPOSpec, LossNormalizers


@dataclass
class GSPOSeam:
    """Per-document quantities (T + 2 slots, 0 where no document is present) and the per-token coefficient."""

    ratio: torch.Tensor  # s_i = exp(mean_{t in i}(new_logp - old_logp))
    advantage: torch.Tensor  # A_i: mean advantage over the document's unmasked tokens
    present: torch.Tensor  # bool: the slot holds a document
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
    length_proportional: loss = sum_i |i|*loss_i / tokens, c_t = w*s_i*A_i/tokens (|i| cancels).
    Every per-token input is 0 on masked tokens (whatever the caller had there, NaN included)."""
    dtype = torch.promote_types(new_logp.dtype, torch.float32)
    slot = _document_slots(document_ids, mask)
    per_token = torch.stack([mask.to(dtype), (new_logp - old_logp).to(dtype), advantages.to(dtype)], dim=1)
    sums = per_token.new_zeros((slot.numel() + 2, 3)).index_add_(0, slot, per_token)
    lengths = sums[:, 0]
    present = lengths > 0
    divisor = lengths.clamp(min=1.0)  # empty slots divide zeros by 1
    means = sums[:, 1:] / divisor.unsqueeze(1)
    ratio = torch.where(present, torch.exp(means[:, 0]), 0.0)
    advantage = means[:, 1]
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
        per_document = slope / divisor * (spec.weight * scale)
    if spec.weight != 0:
        coefficient = per_document[slot]  # slot 0 (masked tokens) holds no document: 0
    else:
        coefficient = new_logp.new_zeros(new_logp.shape, dtype=dtype)
    return GSPOSeam(ratio, advantage, present, loss, coefficient)


def _document_slots(document_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token slot: 0 for masked tokens, 1 + rank of the document id among the unmasked ids
    otherwise (at most T). A sentinel below every id stands for the masked tokens and is prepended
    once, so it always sorts first and takes rank 0."""
    ids = document_ids.to(torch.int64)
    if ids.numel() == 0:
        return ids
    sentinel = (ids.min() - 1).view(1)
    keys, order = torch.sort(torch.cat([sentinel, torch.where(mask, ids, sentinel)]))
    rank = (keys[1:] != keys[:-1]).cumsum(0)  # rank of sorted keys 1..T; key 0 is the sentinel (rank 0)
    slots = torch.zeros_like(keys).scatter_(0, order[1:], rank)
    return slots[1:]
