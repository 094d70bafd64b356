"""Generation with the training decoder: a static KV cache, device sampling, CUDA-graph decode steps."""

from fastlm.generation.backend import GenerationBackend, NativeBackend, TurnSession
from fastlm.generation.generator import Completion, Generator, generate
from fastlm.generation.sampling import SamplingOptions

__all__ = ["Completion", "GenerationBackend", "Generator", "NativeBackend", "SamplingOptions", "TurnSession", "generate"]
