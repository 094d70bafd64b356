"""The DeepSeek-V3 family: multi-head latent attention, shared and sigmoid-routed experts (config.py, hf.py)."""

from fastlm.models.deepseek_v3.config import DeepseekV3Config
from fastlm.models.deepseek_v3.hf import DeepseekV3Adapter
from fastlm.models.family import Family

FAMILY = Family(DeepseekV3Config, DeepseekV3Adapter())
