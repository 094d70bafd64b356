"""The Llama family (also HF Qwen2 and Mistral): config, blocks, HF adapter."""

from fastlm.models.family import Family
from fastlm.models.llama.config import LlamaConfig
from fastlm.models.llama.hf import LlamaAdapter

FAMILY = Family(LlamaConfig, LlamaAdapter())
