"""The one autograd node of the monolithic loss: the gradient is computed in forward, replayed in backward.

Every implementation returns the gradient together with the loss (one pass over the logits, no
saved softmax), so backward only scales the stored gradient by the incoming `grad_output`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fastlm.losses.spec import LossSpec
from fastlm.losses.tensors import LossNormalizers, LossResult, LossTargets, ProcessGroup


class LossImplementation(Protocol):
    """The signature shared by the compiled and Triton paths."""

    def __call__(
        self,
        logits: torch.Tensor,
        targets: LossTargets,
        normalizers: LossNormalizers,
        spec: LossSpec,
        *,
        grad_scale: float = 1.0,
        group: ProcessGroup | None = None,
        compute_grad: bool = True,
        inplace: bool = False,
    ) -> tuple[LossResult, torch.Tensor | None]: ...


@dataclass(frozen=True)
class LossPhases:
    """An implementation split around its torch middle, for a call whose chunks are never all in memory
    (the chunked head with a per-document child): `stats(logits, targets, normalizers, spec, *, group)`
    per chunk -> state; `finish(states, logits, targets, normalizers, spec, *, grad_scale, group)` once
    on the whole call -> (result, coefficients, value-check counts); `grad(logits, targets,
    normalizers, spec, coefficients.rows(chunk), grad, *, group)` per chunk, writing into `grad`
    (which may be the chunk's logits). Every phase takes the same arguments in both implementations."""

    stats: Callable[..., Any]
    finish: Callable[..., tuple[LossResult, Any, torch.Tensor]]
    grad: Callable[..., None]


class _MonolithicLoss(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        implementation: LossImplementation,
        targets: LossTargets,
        normalizers: LossNormalizers,
        spec: LossSpec,
        grad_scale: float,
        group: ProcessGroup | None,
        holder: list[LossResult],
        compute_grad: bool,
    ) -> torch.Tensor:
        result, grad = implementation(
            logits, targets, normalizers, spec, grad_scale=grad_scale, group=group, compute_grad=compute_grad
        )
        ctx.grad = grad
        holder.append(result)
        return result.loss.clone()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = ctx.grad
        # One host read per backward; the multiply over (tokens, vocab) is what it saves.
        if grad is not None and float(grad_output) != 1.0:
            grad = grad * grad_output.to(grad.dtype)
        return (grad, None, None, None, None, None, None, None, None)


def apply_loss(
    implementation: LossImplementation,
    logits: torch.Tensor,
    targets: LossTargets,
    normalizers: LossNormalizers,
    spec: LossSpec,
    grad_scale: float = 1.0,
    group: ProcessGroup | None = None,
) -> LossResult:
    """Run `implementation`; the returned `loss` is connected to `logits` through the stored gradient.

    `grad_scale` is folded into the stored gradient (not into `loss`): it scales what backward
    hands to the logits, as loss scaling or accumulation scaling would.
    """
    holder: list[LossResult] = []
    compute_grad = torch.is_grad_enabled() and logits.requires_grad
    loss = _MonolithicLoss.apply(
        logits, implementation, targets, normalizers, spec, grad_scale, group, holder, compute_grad
    )
    result = holder[0]
    return LossResult(loss, result.losses, result.metrics)
