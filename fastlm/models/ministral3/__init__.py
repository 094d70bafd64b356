"""The Ministral 3 family: config (Mistral's block, yarn RoPE, a query scale growing with position) and HF adapter."""

from fastlm.models.family import Family
from fastlm.models.ministral3.config import Ministral3Config
from fastlm.models.ministral3.hf import Ministral3Adapter

FAMILY = Family(Ministral3Config, Ministral3Adapter())
