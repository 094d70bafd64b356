"""The Phi-3 family: config (the Llama block) and HF adapter (fused qkv / gate_up weights)."""

from fastlm.models.family import Family
from fastlm.models.phi3.config import Phi3Config
from fastlm.models.phi3.hf import Phi3Adapter

FAMILY = Family(Phi3Config, Phi3Adapter())
