"""The Qwen3.5 / Qwen3-Next family: hybrid Gated DeltaNet + gated full attention, dense or mixture of experts."""

from fastlm.models.family import Family
from fastlm.models.qwen3_5.config import Qwen35Config
from fastlm.models.qwen3_5.hf import Qwen35Adapter

FAMILY = Family(Qwen35Config, Qwen35Adapter())
