"""The Gemma 4 family (text; the text tower of the multimodal checkpoints): config, blocks, HF adapter."""

from fastlm.models.family import Family
from fastlm.models.gemma4.config import Gemma4Config
from fastlm.models.gemma4.hf import Gemma4Adapter

FAMILY = Family(Gemma4Config, Gemma4Adapter())
