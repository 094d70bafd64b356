"""DPO on summed sequence log-probs (separate from the shared-softmax loss), with TRL's reward metrics.

loss_k = -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))) per pair k; the head divides the
sum over pairs by `normalizers.documents` (the step's pair count) so accumulation adds up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastlm.losses.tensors import LossNormalizers, LossResult, LossTargets, label_logp, safe_inverse


def sequence_logps(token_logp: torch.Tensor, sequence_index: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """(num_sequences,) sum of per-token log-probs by sequence index (masked tokens must be 0)."""
    return token_logp.new_zeros(num_sequences).index_add(0, sequence_index, token_logp)


def label_sequence_logps(
    logits: torch.Tensor,
    labels: torch.Tensor,
    document_ids: torch.Tensor,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """(sequences,) summed log-prob of the unmasked labels per sequence, in sorted document-id order.

    Shared by the DPO head (policy) and the DPO trainer (frozen reference), so both sum the same way.
    """
    _, index = torch.unique(document_ids, return_inverse=True)
    return sequence_logps(label_logp(logits.float(), labels, logit_scale, softcap), index, int(index.max()) + 1)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair losses (pairs,) and TRL's per-pair reward metrics (not yet reduced)."""
    chosen = beta * (policy_chosen - ref_chosen)
    rejected = beta * (policy_rejected - ref_rejected)
    losses = -F.logsigmoid(chosen - rejected)
    metrics = {
        "rewards/chosen": chosen.detach(),
        "rewards/rejected": rejected.detach(),
        "rewards/margins": (chosen - rejected).detach(),
        "rewards/accuracies": (chosen > rejected).to(chosen.dtype).detach(),
    }
    return losses, metrics


def dpo_head_loss(
    logits: torch.Tensor,
    targets: LossTargets,
    normalizers: LossNormalizers,
    name: str,
    weight: float,
    beta: float,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> LossResult:
    """DPO from (tokens, vocab) logits: per-token label log-probs, summed per sequence, paired 2k/2k+1."""
    if targets.document_ids is None or targets.reference_logps is None:
        raise ValueError(f"dpo loss '{name}' needs targets.document_ids (sequence of each token) and targets.reference_logps")
    policy = label_sequence_logps(logits, targets.labels, targets.document_ids, logit_scale, softcap)
    count = targets.reference_logps.numel()
    if count % 2 or policy.numel() != count:
        raise ValueError(
            f"targets.reference_logps has {count} entries but the batch has {policy.numel()} sequences; "
            "dpo needs one reference log-prob per sequence and an even count (chosen, rejected pairs)"
        )
    reference = targets.reference_logps.to(policy.dtype)
    losses, metrics = dpo_loss(policy[0::2], policy[1::2], reference[0::2], reference[1::2], beta)
    scale = safe_inverse(normalizers.documents)
    loss = losses.sum() * scale
    reduced = {f"{name}/{key}": value.sum() * scale for key, value in metrics.items()}
    return LossResult(weight * loss, {name: loss.detach()}, reduced)
