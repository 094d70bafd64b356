"""AdamW with decoupled weight decay on matrices only, and a warmup + decay learning-rate schedule.

Decay is applied to parameters with two or more dimensions (linear and embedding matrices). Norm
gains and biases are 1-D: shrinking them toward zero only fights the normalisation, so they get none.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fastlm.engine.config import OptimizerConfig, ScheduleConfig


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: >=2-D weights with `weight_decay`, 1-D params (norms, biases) without.

    Tied weights appear once because `named_parameters` de-duplicates shared tensors.
    """
    decay, no_decay = [], []
    for _, parameter in model.named_parameters():
        if parameter.requires_grad:
            (decay if parameter.dim() >= 2 else no_decay).append(parameter)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def fused_available(model: torch.nn.Module) -> bool:
    """torch's fused AdamW (one kernel for the whole update, CUDA or CPU) takes plain tensors; FSDP's
    sharded DTensors keep the default (foreach) implementation."""
    from torch.distributed.tensor import DTensor

    parameters = list(model.parameters())
    return bool(parameters) and all(p.device.type in ("cuda", "cpu") and not isinstance(p, DTensor) for p in parameters)


def build_optimizer(model: torch.nn.Module, config: OptimizerConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        parameter_groups(model, config.weight_decay),
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        fused=True if fused_available(model) else None,
    )


def fused_update(optimizer: torch.optim.Optimizer) -> bool:
    return all(group.get("fused") for group in optimizer.param_groups)


def clip_divisor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What clipping to `max_norm` divides the gradients by, on the device: 1 within it, else about
    norm / max_norm (torch's clip_grad_norm_ coefficient, inverted)."""
    return (max_norm / (norm.float() + 1e-6)).clamp(max=1.0).reciprocal()


def step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor, grad_divisor: torch.Tensor | None = None) -> None:
    """Apply the update unless the device bool `skip` is set, the gradients divided by `grad_divisor` first.

    Fused AdamW does both inside its kernel, driven as AMP's GradScaler drives it (`grad_scale` divides
    the gradients; `found_inf` leaves weights and moments alone and restores the step count): the host
    never waits, and clipping needs no pass over the gradients of its own. Other implementations take no
    divisor (clip in place before) and read `skip` on the host.
    """
    if not fused_update(optimizer):
        if grad_divisor is not None:
            raise ValueError("only fused AdamW divides the gradients itself; clip them in place for this optimizer")
        if not bool(skip):
            optimizer.step()
        return
    optimizer.found_inf = skip.float()  # both read by torch.optim.Adam.step
    if grad_divisor is not None:
        optimizer.grad_scale = grad_divisor
    try:
        optimizer.step()
    finally:
        for name in ("found_inf", "grad_scale"):
            optimizer.__dict__.pop(name, None)


def lr_multiplier(step: int, total_steps: int, config: ScheduleConfig) -> float:
    """Linear warmup to 1 over `warmup_steps`, then cosine/linear decay to `min_lr_ratio` at `total_steps`."""
    if config.warmup_steps and step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    span = max(1, total_steps - config.warmup_steps)
    return decay_multiplier(min(1.0, (step - config.warmup_steps) / span), config)


def decay_multiplier(progress: float, config: ScheduleConfig) -> float:
    """The multiplier `progress` (0..1) of the way through the decay: 1 -> `min_lr_ratio`."""
    if config.decay == "constant":
        return 1.0
    if config.decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * shape


def build_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, config: ScheduleConfig,
    scale: Callable[[int], float] = lambda step: 1.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """The run's schedule times `scale(step)` (an objective's factor, e.g. RL's lr_scale after its warm-up)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, total_steps, config) * scale(step))
