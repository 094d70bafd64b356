"""The loss children of the shared softmax, one file each, registered here once.

A new child adds its file (config class with `to_child`, child class with `tail`, `reference` and,
for the fused kernel, its `slot`: data) and one line below; for the fused kernel a new kind of
per-token math also adds one @triton.jit function (`triton/terms.py`). docs/losses.md lists the places.
"""

from __future__ import annotations

from fastlm.losses.children.base import ChildConfig, LossChild
from fastlm.losses.children.cispo import CISPO, CISPOConfig
from fastlm.losses.children.cross_entropy import CrossEntropy, CrossEntropyConfig
from fastlm.losses.children.distillation import Distillation, DistillationConfig
from fastlm.losses.children.grpo import GRPO, GRPOConfig
from fastlm.losses.children.gspo import GSPO, GSPOConfig
from fastlm.losses.children.z_loss import ZLoss, ZLossConfig

# (config, child) of every child that shares the softmax; the config's `type` is the child's `kind`.
REGISTRY: tuple[tuple[type[ChildConfig], type[LossChild]], ...] = (
    (CrossEntropyConfig, CrossEntropy),
    (ZLossConfig, ZLoss),
    (GRPOConfig, GRPO),
    (GSPOConfig, GSPO),
    (CISPOConfig, CISPO),
    (DistillationConfig, Distillation),
)
CHILD_CONFIGS = tuple(config for config, _ in REGISTRY)
CHILD_CLASSES = tuple(child for _, child in REGISTRY)

__all__ = [
    "CHILD_CLASSES", "CHILD_CONFIGS", "CISPO", "CISPOConfig", "ChildConfig", "CrossEntropy", "CrossEntropyConfig",
    "Distillation", "DistillationConfig", "GRPO", "GRPOConfig", "GSPO", "GSPOConfig", "LossChild", "REGISTRY",
    "ZLoss", "ZLossConfig",
]
