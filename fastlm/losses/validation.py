"""Input checks shared by every loss implementation: bad tensors fail loudly, never as a silent NaN.

Each check names the offending tensor and says what was expected. The value checks (label range,
finiteness of the policy inputs, whether any token is unmasked) are folded into one small flag tensor
read back with a single `.tolist()`: exactly one device->host synchronisation per call on the happy
path (the detailed message is built only when a flag is set). Zero syncs would leave out-of-range
labels to a device-side assert, which poisons the CUDA context and names no tensor, so we keep one.
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


def _raise_non_finite(name: str, tensor: torch.Tensor, mask: torch.Tensor) -> None:
    """Error path only: locate the first unmasked NaN/inf of `tensor` (extra syncs are fine here)."""
    bad = ~torch.isfinite(tensor) & mask
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
    if normalizers.tokens < 0:
        raise ValueError(f"normalizers.tokens must be > 0 when tokens are unmasked, got {normalizers.tokens}")
    mask = labels != IGNORE_INDEX
    out_of_range = mask & ((labels < 0) | (labels >= vocab))
    policy_inputs = _check_policy_inputs(targets, spec, tokens)
    _check_documents(targets, spec, tokens)
    _check_teacher(logits, targets, spec, group)
    # One read-back for every value check: [labels out of range, any token unmasked, per policy input non-finite].
    flags = [out_of_range.any(), mask.any()]
    flags += [(~torch.isfinite(tensor) & mask).any() for _, tensor in policy_inputs]
    bad_labels, has_tokens, *non_finite = torch.stack(flags).tolist()
    if bad_labels:
        index = int(out_of_range.nonzero()[0, 0])
        raise ValueError(
            f"targets.labels[{index}] = {int(labels[index])} is outside the vocabulary [0, {vocab}) "
            f"and is not the ignore index {IGNORE_INDEX}"
        )
    if has_tokens and normalizers.tokens == 0:
        raise ValueError(f"normalizers.tokens must be > 0 when tokens are unmasked, got {normalizers.tokens}")
    for (name, tensor), bad in zip(policy_inputs, non_finite):
        if bad:
            _raise_non_finite(name, tensor, mask)
    gspo = spec.gspo
    if gspo is not None and not gspo.length_proportional and normalizers.documents <= 0 and has_tokens:
        raise ValueError(f"normalizers.documents must be > 0 for gspo sequence_mean, got {normalizers.documents}")
    return mask


def _check_policy_inputs(targets: LossTargets, spec: LossSpec, tokens: int) -> list[tuple[str, torch.Tensor]]:
    """Shape and dtype of old_logp / advantages when a policy child needs them; [(name, tensor)]."""
    policy = [child.name for child in (spec.grpo, spec.gspo) if child is not None]
    if not policy:
        return []
    found = []
    for name in ("old_logp", "advantages"):
        tensor = _check_per_token(name, getattr(targets, name), tokens, f"policy loss {policy}")
        if not tensor.is_floating_point():
            raise ValueError(f"targets.{name} must be a float tensor, got {tensor.dtype}")
        found.append((name, tensor))
    return found


def _check_documents(targets: LossTargets, spec: LossSpec, tokens: int) -> None:
    if spec.gspo is not None:
        ids = _check_per_token("document_ids", targets.document_ids, tokens, f"gspo loss '{spec.gspo.name}'")
        if ids.is_floating_point():
            raise ValueError(f"targets.document_ids must be an integer tensor, got {ids.dtype}")


def _check_teacher(logits: torch.Tensor, targets: LossTargets, spec: LossSpec, group: ProcessGroup | None) -> None:
    if spec.distillation is None:
        return
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
