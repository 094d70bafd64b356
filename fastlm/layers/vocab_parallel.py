"""Vocab-parallel embedding and LM head: each tensor-parallel rank holds V/tp rows of the vocab.

Rank r of the tensor-parallel group holds global ids [r*V/tp, (r+1)*V/tp) of the token embedding
(and of the untied output weight). The rest of the model is replicated over the group and sees the
same data, so two autograd pairs keep the replicated parameters' gradients identical on every rank:

- embedding: each rank looks up the ids in its range (zeros elsewhere); `reduce_from_tp` sums the
  partial outputs (forward all-reduce, backward identity);
- head: `copy_to_tp` hands the replicated hidden states to the sharded logits (forward identity,
  backward all-reduce of the hidden-state gradient: each rank only sees its shard's share).

The loss itself runs in its tensor-parallel form (global max / sum-exp / label logit by all-reduce,
local gradients) in the compiled and Triton implementations, given the group.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from fastlm.losses.spec import LossNormalizers, LossResult, LossTargets, ProcessGroup

if TYPE_CHECKING:  # the head module imports the losses stack; the model imports this module
    from fastlm.layers.lm_head import LMHead

EMBEDDING_NAME = "embeddings.tokens.weight"
OUTPUT_NAME = "lm_head_weight"


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        tensor = tensor.contiguous().clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Identity forward; the gradient is summed over `group` (the input feeds every rank's shard)."""
    return _CopyToTP.apply(tensor, group)


def reduce_from_tp(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum of the ranks' partial outputs; the gradient passes through unchanged."""
    return _ReduceFromTP.apply(tensor, group)


def shard_range(vocab_size: int, group: ProcessGroup) -> tuple[int, int]:
    """(first id, rows) of this rank's equal vocab shard."""
    size = dist.get_world_size(group)
    if vocab_size % size:
        raise ValueError(f"model.vocab_size {vocab_size} is not divisible by tensor_parallel {size}")
    rows = vocab_size // size
    return dist.get_rank(group) * rows, rows


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of a token embedding; ids outside the shard contribute zeros before the sum."""

    def __init__(self, weight: torch.Tensor, start: int, group: ProcessGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.start = start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        partial = nn.functional.embedding(torch.where(inside, local, 0), self.weight)
        partial = partial * inside.unsqueeze(-1).to(partial.dtype)
        return reduce_from_tp(partial, self.group)


def make_vocab_parallel(model: nn.Module, group: ProcessGroup) -> None:
    """Replace a built `DecoderLM`'s token embedding (and untied output weight) by this rank's rows, in place.

    Every rank built the same full weights from the same seed, so the shards are exactly the
    single-process model split by rows.
    """
    start, rows = shard_range(model.config.vocab_size, group)
    tokens = model.embeddings.tokens
    model.embeddings.tokens = VocabParallelEmbedding(tokens.weight.detach()[start : start + rows].clone(), start, group)
    if model.lm_head_weight is not None:
        model.lm_head_weight = nn.Parameter(model.lm_head_weight.detach()[start : start + rows].clone())
    model.tp_group = group


def sharded_parameter_names(model: nn.Module) -> tuple[str, ...]:
    """Names of the parameters that hold a vocab shard (dim 0) on each tensor-parallel rank."""
    if getattr(model, "tp_group", None) is None:
        return ()
    return (EMBEDDING_NAME,) if model.lm_head_weight is None else (EMBEDDING_NAME, OUTPUT_NAME)


def vocab_parallel_loss(
    head: LMHead,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: LossTargets,
    normalizers: LossNormalizers,
    group: ProcessGroup,
) -> LossResult:
    """The head on this rank's vocab shard: teacher logits (or the teacher's head weight) cut to the shard,
    hidden gradient summed over `group`."""
    start = dist.get_rank(group) * weight.shape[0]
    if targets.teacher_logits is not None and targets.teacher_logits.shape[-1] != weight.shape[0]:
        teacher = targets.teacher_logits[:, start : start + weight.shape[0]]
        targets = replace(targets, teacher_logits=teacher.contiguous())
    if targets.teacher_head is not None and targets.teacher_head.weight.shape[0] != weight.shape[0]:
        targets = replace(targets, teacher_head=targets.teacher_head.vocab_rows(start, weight.shape[0]))
    return head(copy_to_tp(hidden, group), weight, targets, normalizers, group=group)


@torch.no_grad()
def gather_vocab(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's vocab shard along the last dim (inference: logits; no gradient)."""
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return torch.cat(pieces, dim=-1)
