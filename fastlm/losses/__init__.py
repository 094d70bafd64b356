"""Losses of the LM head: configs, the plain-number spec, implementations and their dispatch."""

from fastlm.losses.dispatch import describe_implementation, monolithic_loss, resolve_implementation
from fastlm.losses.spec import LossSpec
from fastlm.losses.tensors import LossNormalizers, LossResult, LossTargets, transform_logits

__all__ = [
    "LossNormalizers",
    "LossResult",
    "LossSpec",
    "LossTargets",
    "describe_implementation",
    "monolithic_loss",
    "resolve_implementation",
    "transform_logits",
]
