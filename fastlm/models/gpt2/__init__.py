"""The GPT-2 family: config, blocks, HF adapter."""

from fastlm.models.family import Family
from fastlm.models.gpt2.config import GPT2Config
from fastlm.models.gpt2.hf import GPT2Adapter

FAMILY = Family(GPT2Config, GPT2Adapter())
