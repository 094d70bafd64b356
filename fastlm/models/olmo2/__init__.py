"""The OLMo 2 family: config, blocks, HF adapter."""

from fastlm.models.family import Family
from fastlm.models.olmo2.config import Olmo2Config
from fastlm.models.olmo2.hf import Olmo2Adapter

FAMILY = Family(Olmo2Config, Olmo2Adapter())
