"""The Mixtral family: Mistral attention with a sparse MLP (renormalised top-k) in every layer."""

from fastlm.models.family import Family
from fastlm.models.mixtral.config import MixtralConfig
from fastlm.models.mixtral.hf import MixtralAdapter

FAMILY = Family(MixtralConfig, MixtralAdapter())
