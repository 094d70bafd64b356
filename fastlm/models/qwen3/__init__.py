"""The Qwen3 family (dense): config, blocks, HF adapter."""

from fastlm.models.family import Family
from fastlm.models.qwen3.config import Qwen3Config
from fastlm.models.qwen3.hf import Qwen3Adapter

FAMILY = Family(Qwen3Config, Qwen3Adapter())
