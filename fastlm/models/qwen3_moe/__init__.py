"""The Qwen3-MoE family: Qwen3 attention (per-head QK-norm) with sparse MLPs, dense ones where listed."""

from fastlm.models.family import Family
from fastlm.models.qwen3_moe.config import Qwen3MoeConfig
from fastlm.models.qwen3_moe.hf import Qwen3MoeAdapter

FAMILY = Family(Qwen3MoeConfig, Qwen3MoeAdapter())
