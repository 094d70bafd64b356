"""The OLMo 3 family: OLMo 2's blocks with sliding-window layers (config, HF adapter)."""

from fastlm.models.family import Family
from fastlm.models.olmo3.config import Olmo3Config
from fastlm.models.olmo3.hf import Olmo3Adapter

FAMILY = Family(Olmo3Config, Olmo3Adapter())
