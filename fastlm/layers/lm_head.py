"""The LM head: output projection plus the losses on its logits, through one dispatched implementation.

The implementation (Triton or compiled) is chosen once, from the config and the device of the first
call (or the device given at construction), and kept: a head never switches paths mid-run.

The head is opaque to torch.compile (`torch.compiler.disable`): a compiled model breaks its graph once,
here, and runs the loss as its own implementation (Triton kernels, or the loss's own compiled
chunks) instead of dynamo tracing into the Triton launcher and its helpers.
"""

from __future__ import annotations

import torch
from torch import nn

from fastlm.losses.config import DPOConfig, LMHeadConfig
from fastlm.losses.dispatch import describe_implementation, monolithic_loss, resolve_implementation
from fastlm.losses.dpo import dpo_head_loss
from fastlm.losses.spec import LossNormalizers, LossResult, LossSpec, LossTargets, ProcessGroup


class LMHead(nn.Module):
    """logits = hidden @ weight.T (weight: the output embedding, or this rank's vocab shard of it)."""

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

    def describe(self) -> str:
        """One line for the dry run and wandb config."""
        if self._dpo:
            name, child = self._dpo
            return f"loss: dpo '{name}' on summed sequence log-probs (beta={child.beta:g}, w={child.weight:g})"
        device = self._device or torch.device("cpu")
        implementation = self._implementation or resolve_implementation(self.monolithic, device)
        return describe_implementation(self.monolithic, implementation, device)

    @torch.compiler.disable
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
        logits = hidden @ weight.t()
        if self._dpo:
            name, child = self._dpo
            config = self.config
            return dpo_head_loss(logits, targets, normalizers, name, child.weight, child.beta, config.logit_scale, config.softcap)
        return monolithic_loss(logits, targets, normalizers, self.spec, implementation, grad_scale, group)
