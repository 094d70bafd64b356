"""The Ministral family (Ministral-8B): the Llama config and blocks, exported as HF `ministral`."""

from fastlm.models.family import Family
from fastlm.models.ministral.config import MinistralConfig
from fastlm.models.ministral.hf import MinistralAdapter

FAMILY = Family(MinistralConfig, MinistralAdapter())
