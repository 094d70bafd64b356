"""The Qwen2-MoE family: Qwen2 attention with experts and a sigmoid-gated shared expert."""

from fastlm.models.family import Family
from fastlm.models.qwen2_moe.config import Qwen2MoeConfig
from fastlm.models.qwen2_moe.hf import Qwen2MoeAdapter

FAMILY = Family(Qwen2MoeConfig, Qwen2MoeAdapter())
