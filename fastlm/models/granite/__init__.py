"""The Granite family (dense): config, blocks, HF adapter."""

from fastlm.models.family import Family
from fastlm.models.granite.config import GraniteConfig
from fastlm.models.granite.hf import GraniteAdapter

FAMILY = Family(GraniteConfig, GraniteAdapter())
