"""The Gemma 2 family: config, blocks, HF adapter."""

from fastlm.models.family import Family
from fastlm.models.gemma2.config import Gemma2Config
from fastlm.models.gemma2.hf import Gemma2Adapter

FAMILY = Family(Gemma2Config, Gemma2Adapter())
