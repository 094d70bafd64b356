"""The GPT-OSS family: config, HF adapter (blocks from fastlm/layers: attention sinks, the biased MoE)."""

from fastlm.models.family import Family
from fastlm.models.gpt_oss.config import GptOssConfig
from fastlm.models.gpt_oss.hf import GptOssAdapter

FAMILY = Family(GptOssConfig, GptOssAdapter())
