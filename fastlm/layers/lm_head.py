"""The LM head: output projection plus the losses on its logits, through one dispatched implementation.

The implementation (Triton or compiled) is chosen once, from the config and the device of the first
call (or the device given at construction), and kept: a head never switches paths mid-run.

The head is opaque to torch.compile (`torch.compiler.disable`): a compiled model breaks its graph once,
here, and runs the loss as its own implementation (Triton kernels, or the loss's own compiled
chunks) instead of dynamo tracing into the Triton launcher and its helpers.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from fastlm.losses.chunked_head import chunked_head_loss, chunking
from fastlm.losses.config import DEFAULT_LOGITS_MEMORY_MIB, DPOConfig, LMHeadConfig
from fastlm.losses.dispatch import describe_implementation, monolithic_loss, resolve_implementation
from fastlm.losses.dpo import dpo_head_loss
from fastlm.losses.spec import LossNormalizers, LossResult, LossSpec, LossTargets, ProcessGroup


class LMHead(nn.Module):
    """logits = hidden @ weight.T (weight: the output embedding, or this rank's vocab shard of it), and
    the losses on them: over token chunks without the full logits (`logits_memory_mib` > 0, the
    default; losses/chunked_head.py), or on the full logits (0, and DPO)."""

    def __init__(self, config: LMHeadConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        self._dpo: tuple[str, DPOConfig] | None = None
        if config.is_dpo:
            name, child = next(iter(config.losses.items()))
            self._dpo = (name, child)  # validation keeps dpo alone in losses
            self.spec = None
        else:
            self.monolithic = config.monolithic()
            self.spec = LossSpec.from_config(self.monolithic)
        self._implementation: str | None = None
        self._device: torch.device | None = None
        if device is not None:
            self.resolve(device)

    def resolve(self, device: torch.device | str) -> str:
        """Choose the implementation for `device` once; later calls return the stored choice."""
        if self._implementation is None:
            self._device = torch.device(device)
            self._implementation = "dpo" if self._dpo else resolve_implementation(self.monolithic, self._device)
        return self._implementation

    @property
    def implementation(self) -> str | None:
        """"triton", "compiled" or "dpo"; None until the first call (or a device at construction)."""
        return self._implementation

    @property
    def logits_memory_mib(self) -> float:
        """The chunked head's logits budget; 0: the full-logits head (always for DPO)."""
        if self._dpo:
            return 0.0
        budget = self.config.logits_memory_mib
        return DEFAULT_LOGITS_MEMORY_MIB if budget is None else budget

    @property
    def chunked(self) -> bool:
        """Whether the loss runs over token chunks without the full logits (chunked_head.py)."""
        return self.logits_memory_mib > 0

    def describe(self, tokens: int | None = None, vocab: int | None = None, dtype: torch.dtype | None = None) -> str:
        """One line for the dry run and wandb config; with the call's shape (tokens per micro-batch, this
        rank's vocab, the GEMMs' dtype) it also says the chunk size."""
        if self._dpo:
            name, child = self._dpo
            return f"loss: dpo '{name}' on summed sequence log-probs (beta={child.beta:g}, w={child.weight:g})"
        device = self._device or torch.device("cpu")
        implementation = self._implementation or resolve_implementation(self.monolithic, device)
        return describe_implementation(self.monolithic, implementation, device) + "; " + self._describe_head(tokens, vocab, dtype)

    def _describe_head(self, tokens: int | None, vocab: int | None, dtype: torch.dtype | None) -> str:
        budget = self.logits_memory_mib
        if not budget:
            return "head: full logits (logits_memory_mib 0)"
        line = f"head: chunked, no full logits (logits_memory_mib {budget:g})"
        if tokens is None or vocab is None:
            return line
        dtype = dtype or torch.float32
        plan = chunking(tokens, vocab, dtype.itemsize, budget, self.spec.teacher is not None)
        count = -(-tokens // plan.tokens)
        passes = ", two passes: 4 GEMMs for the whole-call child" if self.spec.whole_call and count > 1 else ""
        teacher = f", the teacher's logits {plan.teacher_tokens} at a time" if 0 < plan.teacher_tokens < plan.tokens else ""
        return (f"{line}: {plan.tokens} of {tokens} tokens a chunk ({count} chunk{'s' * (count > 1)}{passes}{teacher}) "
                f"at vocab {vocab} in {str(dtype).removeprefix('torch.')}")

    @torch._disable_dynamo  # torch.compiler.disable, applied at the first call (its import of dynamo costs ~1 s)
    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: LossTargets,
        normalizers: LossNormalizers,
        group: ProcessGroup | None = None,
        grad_scale: float = 1.0,
    ) -> LossResult:
        if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
            raise ValueError(
                f"LMHead needs hidden (tokens, H) and weight (vocab, H); got {tuple(hidden.shape)} and {tuple(weight.shape)}"
            )
        implementation = self.resolve(hidden.device)
        if self.chunked:
            return chunked_head_loss(hidden, weight, targets, normalizers, self.spec, implementation,
                                     self.logits_memory_mib, grad_scale=grad_scale, group=group)
        logits = hidden @ weight.t()
        if self._dpo:
            name, child = self._dpo
            config = self.config
            return dpo_head_loss(logits, targets, normalizers, name, child.weight, child.beta, config.logit_scale, config.softcap)
        if targets.teacher_logits is None and targets.teacher_head is not None and self.spec.teacher is not None:
            targets = replace(targets, teacher_logits=targets.teacher_head.logits(logits.dtype), teacher_head=None)
        return monolithic_loss(logits, targets, normalizers, self.spec, implementation, grad_scale, group)
