"""The unit the trainer consumes: one micro-batch of packed rows with shifted, masked labels."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from fastlm.data.datasets import DataError
from fastlm.losses.spec import IGNORE_INDEX, LossTargets, TeacherHead


@dataclass
class Batch:
    """Tensors of shape (B, S). `labels[t]` is the token at t+1, or -100 where nothing is predicted."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    document_ids: torch.Tensor
    padding: torch.Tensor | None = None  # bool, True where a row is padded past its data (None: no padding)
    old_logp: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    teacher_logits: torch.Tensor | None = None  # (B, S, V)
    teacher_head: TeacherHead | None = None  # instead of teacher_logits for a chunked head: hidden (B, S, Ht) + weight
    ref_logp: torch.Tensor | None = None  # policy loss with beta > 0: label log-prob under the frozen reference
    routed_experts: torch.Tensor | None = None  # (B, S, M, k) int16: the sampler's experts per token (routing replay)

    def __post_init__(self) -> None:
        shape = tuple(self.input_ids.shape)
        if len(shape) != 2:
            raise ValueError(f"Batch.input_ids must be (batch, seq), got shape {shape}")
        for item in fields(self):
            value = getattr(self, item.name)
            if value is not None and tuple(value.shape[:2]) != shape:
                raise ValueError(f"Batch.{item.name} has shape {tuple(value.shape)}, expected {shape} leading dims")

    def check_token_ids(self, vocab_size: int) -> None:
        """Ids outside the vocab crash the embedding (a CUDA device assert on GPU); name the tensor instead."""
        for name, values in (("input_ids", self.input_ids), ("labels", self.labels[self.labels != IGNORE_INDEX])):
            bad = values[(values < 0) | (values >= vocab_size)]
            if bad.numel():  # a DataError: `train` reports it in one line and exits 1
                raise DataError(
                    f"Batch.{name} holds token id {int(bad[0])} outside 0..{vocab_size - 1} (model.vocab_size "
                    f"{vocab_size}; {bad.numel()} such ids in this batch): the data does not match the model's vocab"
                )

    @property
    def num_tokens(self) -> int:
        """Unmasked labels: the share of the step's token normaliser this batch brings."""
        return int((self.labels != IGNORE_INDEX).sum())

    @property
    def num_positions(self) -> int:
        """Input positions that are not padding: the tokens the MoE router losses average over."""
        return self.input_ids.numel() - (0 if self.padding is None else int(self.padding.sum()))

    @property
    def num_documents(self) -> int:
        """Distinct documents with at least one unmasked label (ids are unique across rows of a batch)."""
        return int(torch.unique(self.document_ids[self.labels != IGNORE_INDEX]).numel())

    def targets(self) -> LossTargets:
        """Flatten to the per-token tensors the LM head reads."""
        return LossTargets(
            labels=self.labels.reshape(-1),
            old_logp=None if self.old_logp is None else self.old_logp.reshape(-1),
            advantages=None if self.advantages is None else self.advantages.reshape(-1),
            document_ids=self.document_ids.reshape(-1),
            teacher_logits=None
            if self.teacher_logits is None
            else self.teacher_logits.reshape(-1, self.teacher_logits.shape[-1]),
            ref_logp=None if self.ref_logp is None else self.ref_logp.reshape(-1),
            teacher_head=None if self.teacher_head is None else self.teacher_head.flatten(),
        )

    def to(self, device: torch.device | str) -> Batch:
        """A copy with every tensor on `device`. Host tensors reach a GPU through pinned memory without
        blocking: a pageable copy would make the host wait for the GPU to finish its queue (a sync per
        step); the stream orders the copy before the kernels that read it."""
        device = torch.device(device)
        moved = {
            item.name: _moved(getattr(self, item.name), device)
            for item in fields(self)
            if getattr(self, item.name) is not None
        }
        return replace(self, **moved)


def _moved(tensor: torch.Tensor | TeacherHead, device: torch.device) -> torch.Tensor | TeacherHead:
    if not isinstance(tensor, torch.Tensor) or device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def batch_from_rows(tokens: torch.Tensor, document_ids: torch.Tensor, target_mask: torch.Tensor,
                    padding: torch.Tensor | None = None) -> Batch:
    """Shift packed rows of S+1 tokens into a Batch.

    A label is kept only where token t+1 may be a target (not a prompt or padding token) and t, t+1 belong
    to the same document piece. Document ids are renumbered 0..n-1 across the whole batch so a row drawn
    twice (epoch wrap) never merges with itself in per-document losses. `padding` flags the tokens past a
    row's data (None: there are none).
    """
    if tokens.shape != document_ids.shape or tokens.shape != target_mask.shape or tokens.dim() != 2:
        raise ValueError(
            f"rows must share one (batch, seq+1) shape: tokens {tuple(tokens.shape)}, "
            f"document_ids {tuple(document_ids.shape)}, target_mask {tuple(target_mask.shape)}"
        )
    same_doc = document_ids[:, :-1] == document_ids[:, 1:]
    keep = same_doc & target_mask[:, 1:]
    labels = torch.where(keep, tokens[:, 1:], torch.full_like(tokens[:, 1:], IGNORE_INDEX))
    row_offset = torch.arange(tokens.shape[0]).unsqueeze(1) * (int(document_ids.max()) + 1)
    _, renumbered = torch.unique(document_ids[:, :-1] + row_offset, return_inverse=True)
    return Batch(input_ids=tokens[:, :-1].contiguous(), labels=labels, document_ids=renumbered.reshape(labels.shape),
                 padding=None if padding is None else padding[:, :-1].contiguous())
