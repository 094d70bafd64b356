"""The SmolLM3 family: config (the Llama block, some layers without RoPE) and HF adapter."""

from fastlm.models.family import Family
from fastlm.models.smollm3.config import SmolLM3Config
from fastlm.models.smollm3.hf import SmolLM3Adapter

FAMILY = Family(SmolLM3Config, SmolLM3Adapter())
