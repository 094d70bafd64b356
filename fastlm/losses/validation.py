"""Input checks shared by every loss implementation: bad tensors fail loudly, never as a silent NaN.

Each check names the offending tensor and says what was expected. The checks read a few values back
from the device (label range, finiteness), which costs one synchronisation per call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fastlm.losses.spec import IGNORE_INDEX, LossNormalizers, LossSpec, LossTargets

ProcessGroup = dist.ProcessGroup


def vocab_shard(logits: torch.Tensor, group: ProcessGroup | None) -> tuple[int, int]:
    """(first global vocab id of this rank's shard, global vocab size) of a vocab-parallel head.

    Shards are equal and laid out by rank, so rank r holds ids [r*V_local, (r+1)*V_local).
    """
    local = logits.shape[-1]
    if group is None:
        return 0, local
    return dist.get_rank(group) * local, dist.get_world_size(group) * local


def _check_per_token(name: str, tensor: torch.Tensor | None, tokens: int, needed_by: str) -> torch.Tensor:
    if tensor is None:
        raise ValueError(f"targets.{name} is required by {needed_by} but is None")
    if tensor.shape != (tokens,):
        raise ValueError(f"targets.{name} must have shape ({tokens},) like the labels, got {tuple(tensor.shape)}")
    return tensor


def _check_finite(name: str, tensor: torch.Tensor, mask: torch.Tensor) -> None:
    bad = ~torch.isfinite(tensor) & mask
    if bool(bad.any()):
        index = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"targets.{name} has a non-finite value ({float(tensor[index])}) at unmasked token {index}; "
            f"{int(bad.sum())} unmasked tokens are NaN/inf"
        )


def validate_loss_inputs(
    logits: torch.Tensor,
    targets: LossTargets,
    normalizers: LossNormalizers,
    spec: LossSpec,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """Raise `ValueError` naming the bad tensor; return the boolean mask of unmasked tokens."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be (tokens, vocab), got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor, got {logits.dtype}")
    tokens = logits.shape[0]
    labels = targets.labels
    if labels.shape != (tokens,):
        raise ValueError(f"targets.labels must have shape ({tokens},) to match logits {tuple(logits.shape)}, got {tuple(labels.shape)}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets.labels must be int64 (or int32), got {labels.dtype}")
    _, vocab = vocab_shard(logits, group)
    mask = labels != IGNORE_INDEX
    out_of_range = mask & ((labels < 0) | (labels >= vocab))
    if bool(out_of_range.any()):
        index = int(out_of_range.nonzero()[0, 0])
        raise ValueError(
            f"targets.labels[{index}] = {int(labels[index])} is outside the vocabulary [0, {vocab}) "
            f"and is not the ignore index {IGNORE_INDEX}"
        )
    has_tokens = bool(mask.any())
    if normalizers.tokens < 0 or (has_tokens and normalizers.tokens == 0):
        raise ValueError(f"normalizers.tokens must be > 0 when tokens are unmasked, got {normalizers.tokens}")
    policy = [child.name for child in (spec.grpo, spec.gspo) if child is not None]
    if policy:
        for name in ("old_logp", "advantages"):
            tensor = _check_per_token(name, getattr(targets, name), tokens, f"policy loss {policy}")
            if not tensor.is_floating_point():
                raise ValueError(f"targets.{name} must be a float tensor, got {tensor.dtype}")
            _check_finite(name, tensor, mask)
    if spec.gspo is not None:
        ids = _check_per_token("document_ids", targets.document_ids, tokens, f"gspo loss '{spec.gspo.name}'")
        if ids.is_floating_point():
            raise ValueError(f"targets.document_ids must be an integer tensor, got {ids.dtype}")
        if not spec.gspo.length_proportional and normalizers.documents <= 0 and has_tokens:
            raise ValueError(f"normalizers.documents must be > 0 for gspo sequence_mean, got {normalizers.documents}")
    if spec.distillation is not None:
        teacher = targets.teacher_logits
        if teacher is None:
            raise ValueError(f"targets.teacher_logits is required by distillation loss '{spec.distillation.name}' but is None")
        if teacher.shape != logits.shape:
            raise ValueError(
                f"targets.teacher_logits must have the student's shape {tuple(logits.shape)} "
                f"(same tokens, same vocab{' shard' if group is not None else ''}), got {tuple(teacher.shape)}"
            )
        if not teacher.is_floating_point():
            raise ValueError(f"targets.teacher_logits must be a float tensor, got {teacher.dtype}")
    return mask
