"""Losses of the LM head: configs, the plain-number spec, implementations and their dispatch."""

from fastlm.losses.dispatch import describe_implementation, monolithic_loss, resolve_implementation
from fastlm.losses.spec import LossNormalizers, LossResult, LossSpec, LossTargets, transform_logits

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
