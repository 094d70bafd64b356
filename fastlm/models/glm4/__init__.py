"""The GLM-4 family: config, blocks, HF adapter."""

from fastlm.models.family import Family
from fastlm.models.glm4.config import Glm4Config
from fastlm.models.glm4.hf import Glm4Adapter

FAMILY = Family(Glm4Config, Glm4Adapter())
