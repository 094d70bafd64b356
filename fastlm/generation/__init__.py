"""Generation with the training decoder: a static KV cache, device sampling, CUDA-graph decode steps."""

from fastlm.generation.generator import Completion, Generator, generate
from fastlm.generation.sampling import SamplingOptions

__all__ = ["Completion", "Generator", "SamplingOptions", "generate"]
