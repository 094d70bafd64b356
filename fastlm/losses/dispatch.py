"""The use_triton rules: pick one implementation per head, once, and say which.

- use_triton true: Triton (config validation already rejected children without a Triton path);
- null: Triton on CUDA when every child is in TRITON_CHILD_TYPES (every monolithic child) with options the
  kernel runs (`ChildConfig.triton_supported`) and triton
  imports, else compiled;
- false: compiled.
"""

from __future__ import annotations

import importlib.util

import torch

from fastlm.losses.compiled import compile_wanted, compiled_finish, compiled_grad, compiled_loss, compiled_stats
from fastlm.losses.config import TRITON_CHILD_TYPES, MonolithicLossConfig
from fastlm.losses.function import LossImplementation, LossPhases, apply_loss
from fastlm.losses.spec import LossSpec
from fastlm.losses.tensors import LossNormalizers, LossResult, LossTargets, ProcessGroup

IMPLEMENTATIONS: tuple[str, ...] = ("triton", "compiled")


def resolve_implementation(config: MonolithicLossConfig, device: torch.device | str) -> str:
    """"triton" or "compiled" for this head on this device."""
    device = torch.device(device)
    if config.use_triton is True:
        return "triton"
    if config.use_triton is False or device.type != "cuda":
        return "compiled"
    supported = all(child.type in TRITON_CHILD_TYPES and child.triton_supported for child in config.children.values())
    return "triton" if supported and importlib.util.find_spec("triton") is not None else "compiled"


def describe_implementation(config: MonolithicLossConfig, implementation: str, device: torch.device | str) -> str:
    """One line for the dry run and the wandb config."""
    children = ", ".join(f"{name} ({child.type}, w={child.weight:g})" for name, child in config.children.items())
    if implementation == "triton":
        how = "fused Triton kernel"
    else:
        mode = "torch.compile" if compile_wanted(torch.device(device)) else "eager"
        how = f"compiled PyTorch path ({mode}, chunks of {config.chunk_tokens} tokens)"
    numbers = f"logit_scale={config.logit_scale:g}" + (f", softcap={config.softcap:g}" if config.softcap else "")
    return f"loss: {how} (use_triton={config.use_triton}) for {children}; {numbers}"


def get_implementation(implementation: str) -> LossImplementation:
    """The function behind a name; the Triton launcher is imported only when asked for."""
    if implementation == "compiled":
        return compiled_loss
    if implementation == "triton":
        from fastlm.losses.triton.launcher import triton_loss

        return triton_loss
    raise ValueError(f"unknown loss implementation {implementation!r}; expected one of {IMPLEMENTATIONS}")


def get_phases(implementation: str) -> LossPhases:
    """The stats / finish / grad phases of an implementation (the chunked head's two passes)."""
    if implementation == "compiled":
        return LossPhases(compiled_stats, compiled_finish, compiled_grad)
    if implementation == "triton":
        from fastlm.losses.triton.launcher import triton_finish, triton_grad, triton_stats

        return LossPhases(triton_stats, triton_finish, triton_grad)
    raise ValueError(f"unknown loss implementation {implementation!r}; expected one of {IMPLEMENTATIONS}")


def monolithic_loss(
    logits: torch.Tensor,
    targets: LossTargets,
    normalizers: LossNormalizers,
    spec: LossSpec,
    implementation: str,
    grad_scale: float = 1.0,
    group: ProcessGroup | None = None,
) -> LossResult:
    """The autograd-connected loss: `result.loss.backward()` sends the implementation's gradient to `logits`."""
    return apply_loss(get_implementation(implementation), logits, targets, normalizers, spec, grad_scale, group)
