"""What RL rollouts and the greedy eval need from a sampler: the generation backend interface.

A backend samples completions from the policy the trainer is training. The rollout (fastlm/rl/rollout.py)
calls `sync_weights(weights, version)` once before it generates, so a backend that holds its own copy of the
weights (a CUDA-graph replica, an HF replica, an inference server) samples the weights of the current step,
and every completion records that policy `version`; `generate` returns token ids and the sampler's
log-probs; `session` decodes a batch of multi-turn episodes turn by turn. `rl.backend` picks and builds one
(backend_config.py).

`NativeBackend` samples on the trainer's own model: the continuous-batching `Engine`
(engine.py: paged KV cache, prompt prefixes shared by a group's samples, `EngineSession` for multi-turn) when
asked for and the model is one it serves, else the static KV-cache `Generator` (generator.py) and
`Continuation` (continuation.py). Both draw the same tokens for the same seeds. `TransformersBackend`
(hf_backend.py) samples with transformers' `generate`. docs/rl.md says what a vLLM or SGLang server
backend would implement instead (weight sync, the sampling options' mapping, what it must return).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Literal, Protocol

import torch

from fastlm.generation.continuation import Continuation
from fastlm.generation.engine import Engine, EngineSession, engine_supports
from fastlm.generation.generator import Completion, Generator, TokenizerLike
from fastlm.generation.sampling import SamplingOptions
from fastlm.models.decoder import DecoderLM

Weights = Iterable[tuple[str, torch.Tensor]]  # (fastlm name, full tensor) of every base parameter, LoRA merged


class TurnSession(Protocol):
    """One batch of rows decoded turn by turn; a row left out of `extend` is finished."""

    def room(self, row: int, appended: int) -> bool:
        """Whether `row` can take `appended` more tokens and then at least one sampled token."""
        ...

    def start(self, prompts: list[list[int]], generator: torch.Generator | None = None) -> list[Completion]:
        """The first turn of every row (one completion per prompt)."""
        ...

    def extend(self, appended: dict[int, list[int]], generator: torch.Generator | None = None) -> dict[int, Completion]:
        """Append tokens to the rows that go on and sample their next turn."""
        ...


class GenerationBackend(Protocol):
    """A sampler of the trainer's policy (see the module docstring)."""

    def sync_weights(self, weights: Weights | None, version: int) -> None:
        """Make the next generations sample `weights` (the trainer's current ones, `merged_weights(model)`; None:
        those of the model the backend was built on, read by the backend itself), which are policy `version`
        (the trainer's step): every completion until the next sync records it."""
        ...

    def generate(self, prompts: list[list[int]], options: SamplingOptions,
                 generator: torch.Generator | None = None) -> list[Completion]:
        """One completion per prompt: its token ids (the stop token included) and their log-probs under the
        sampling distribution; `generator` seeds the draws."""
        ...

    def session(self, options: SamplingOptions, limit: int) -> TurnSession:
        """A multi-turn session whose rows hold at most `limit` tokens each, prompt included."""
        ...


def stamped(completions: list[Completion], version: int) -> list[Completion]:
    """The completions with the policy version they were sampled with."""
    return [replace(c, policy_version=version) for c in completions]


class VersionedSession:
    """A `TurnSession` whose completions carry the policy version of the weights they were sampled with."""

    def __init__(self, session: TurnSession, version: int) -> None:
        self.inner, self.version = session, version

    def room(self, row: int, appended: int) -> bool:
        return self.inner.room(row, appended)

    def start(self, prompts: list[list[int]], generator: torch.Generator | None = None) -> list[Completion]:
        return stamped(self.inner.start(prompts, generator), self.version)

    def extend(self, appended: dict[int, list[int]], generator: torch.Generator | None = None) -> dict[int, Completion]:
        turns = self.inner.extend(appended, generator)
        return dict(zip(turns, stamped(list(turns.values()), self.version)))


class NativeBackend:
    """The KV-cache generator on the trainer's model: eager decoding reads the live weights (nothing to sync);
    the CUDA-graph path decodes a replica that `sync_weights` refreshes. `engine=True`: the continuous-
    batching engine with `max_slots` decode slots and a paged cache of `kv_cache_memory_gib` (None: a share
    of the free device memory), for the families it serves (others, silently, the static path). Static
    multi-turn sessions need `padding="right"` (each row at its own cache columns). `record_routing` (an MoE
    model, single-turn): each completion carries its tokens' experts (routing replay)."""

    def __init__(self, model: DecoderLM, tokenizer: TokenizerLike, amp_dtype: torch.dtype | None = None,
                 cuda_graph: bool = False, compile: bool = False, padding: Literal["left", "right"] = "left",
                 engine: bool = False, max_slots: int = 256, kv_cache_memory_gib: float | None = None,
                 record_routing: bool = False) -> None:
        self.generator = Generator(model, tokenizer, amp_dtype, cuda_graph=cuda_graph, compile=compile, padding=padding,
                                   sync_on_generate=False, record_routing=record_routing)
        self.engine = (Engine(self.generator, max_slots, kv_cache_memory_gib=kv_cache_memory_gib)
                       if engine and engine_supports(model) else None)
        self.version = 0

    def sync_weights(self, weights: Weights | None, version: int) -> None:
        """Eager decoding reads the live model (the weights are its own); the graph path copies them."""
        self.version = version
        if self.generator.cuda_graph:
            self.generator.sync_weights(weights)

    def generate(self, prompts: list[list[int]], options: SamplingOptions,
                 generator: torch.Generator | None = None) -> list[Completion]:
        if self.engine is not None:
            return stamped(self.engine.generate(prompts, options, generator), self.version)
        return stamped(self.generator.generate(prompts, options, generator), self.version)

    def session(self, options: SamplingOptions, limit: int) -> VersionedSession:
        inner: Continuation | EngineSession = (self.engine.session(options, limit) if self.engine is not None
                                               else Continuation(self.generator, options, limit))
        return VersionedSession(inner, self.version)
