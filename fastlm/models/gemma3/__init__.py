"""The Gemma 3 family (text): config, blocks, HF adapter."""

from fastlm.models.family import Family
from fastlm.models.gemma3.config import Gemma3Config
from fastlm.models.gemma3.hf import Gemma3Adapter

FAMILY = Family(Gemma3Config, Gemma3Adapter())
