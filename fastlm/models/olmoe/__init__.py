"""The OLMoE family: Llama attention with RMSNorm over all of q and of k, a sparse MLP in every layer."""

from fastlm.models.family import Family
from fastlm.models.olmoe.config import OlmoeConfig
from fastlm.models.olmoe.hf import OlmoeAdapter

FAMILY = Family(OlmoeConfig, OlmoeAdapter())
