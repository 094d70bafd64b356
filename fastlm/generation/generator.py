"""Batched generation with the training decoder and a static KV cache.

One prefill forward writes the prompts' keys and values into a preallocated cache (fastlm/layers/kv_cache.py)
and gives the first token's logits; then each decode step feeds the B last tokens, writes one cache column
and computes the head at that position only. Sampling, stop tokens and per-row finishing stay on the device;
the host reads the device once every `check_every` steps (to end early when every row has stopped) and once
at the end.

On CUDA (`cuda_graph=True`, the default there) the decode step runs on a bf16 replica of the weights
(linear weights and the head in the autocast dtype, embeddings and norms as trained: the training forward's
numerics) and is captured once in a `torch.cuda.CUDAGraph`, optionally after `torch.compile`; a `Generator`
kept across calls reuses the graph while the batch size and cache length stay the same and only copies
the live weights into the replica (`sync_weights`). On CPU, or without the graph, the live model runs
eagerly under the given autocast.

Prompts are left-padded by default (every row writes the same cache column each step); `padding="right"`
keeps each row at its own columns. Both give the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from fastlm.engine.runtime import autocast
from fastlm.generation.sampling import SamplingOptions, pick_tokens
from fastlm.layers.kv_cache import KVCache
from fastlm.models.decoder import DecoderLM, build_model

CACHE_ROUNDING = 64  # graph path: cache lengths are rounded up to this, so a graph serves nearby prompt widths
KEPT_GRAPHS = 2  # graph path: decode steps kept per Generator (e.g. rollouts and the greedy eval's batch size)


class TokenizerLike(Protocol):
    pad_id: int | None
    eos_id: int | None


@dataclass(frozen=True)
class Completion:
    """Sampled tokens (the stop token included when one was drawn) and their log-probs under the sampling
    distribution (after the head's transform, temperature, top-k and top-p; greedy: the untempered softmax)."""

    tokens: list[int]
    logprobs: list[float]
    stopped: bool


def check_prompts(prompts: list[list[int]], options: SamplingOptions, model: DecoderLM) -> None:
    """Clear errors for what would otherwise fail inside the forward (or silently overrun positions)."""
    if not prompts:
        raise ValueError("generation needs at least one prompt")
    limit = model.config.max_seq_len - options.max_new_tokens
    vocab = model.config.vocab_size
    for index, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {index} is empty; every prompt needs at least one token (BOS)")
        if len(prompt) > limit:
            raise ValueError(
                f"prompt {index} has {len(prompt)} tokens, more than model.max_seq_len ({model.config.max_seq_len}) "
                f"- max_new_tokens ({options.max_new_tokens}) = {limit}; shorten it or lower max_new_tokens"
            )
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt {index} has token ids outside [0, {vocab}) (model.vocab_size)")
    bad_stops = [t for t in options.stop_tokens if not 0 <= t < vocab]
    if bad_stops:
        raise ValueError(f"stop tokens {bad_stops} are outside the model's vocab [0, {vocab})")


class _DecodeStep:
    """One decode step (B tokens at cache columns -> float32 logits (B, V)) on fixed buffers, optionally
    compiled and captured in a CUDA graph."""

    def __init__(self, model: DecoderLM, cache: KVCache, head_weight: torch.Tensor | None,
                 amp_dtype: torch.dtype | None, cuda_graph: bool, compile: bool) -> None:
        self.model, self.cache, self.head_weight, self.amp_dtype = model, cache, head_weight, amp_dtype
        device = cache.start.device
        self.tokens = torch.zeros(cache.batch, 1, dtype=torch.int64, device=device)
        self.columns = torch.zeros(cache.batch, 1, dtype=torch.int64, device=device)
        self.run = self.forward
        if compile:
            for buffer in cache.buffers:  # updated in place every step: not an input to copy or guard on
                torch._dynamo.mark_static_address(buffer)
            self.run = torch.compile(self.forward, fullgraph=True, dynamic=False)
        self.graph: torch.cuda.CUDAGraph | None = None
        if cuda_graph:
            self._capture()

    def forward(self) -> torch.Tensor:
        device = self.tokens.device
        context = autocast(device, self.amp_dtype) if self.amp_dtype is None else torch.autocast(
            device.type, dtype=self.amp_dtype, cache_enabled=False)  # no cast cache: a graph must not keep one
        with context:
            hidden = self.model.cached_hidden_states(self.tokens, self.cache, self.columns, self.cache.length)
            return self.model.head_logits(hidden[:, -1], self.head_weight).float()

    def _capture(self) -> None:
        """Warm up on a side stream (compiles, picks kernels), then capture. Runs before any prefill, so
        the warm-up's cache writes are overwritten."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                self.run()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = self.run()

    def __call__(self, tokens: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.columns.copy_(columns)
        if self.graph is None:
            return self.run()
        self.graph.replay()
        return self.output


class Generator:
    """Reusable generation engine for one model (see the module docstring).

    `cuda_graph=None` means "on when the model is on CUDA"; `compile=True` runs the decode step through
    torch.compile first (worth it for many small kernels; costs a compile per new shape).
    """

    def __init__(
        self,
        model: DecoderLM,
        tokenizer: TokenizerLike,
        amp_dtype: torch.dtype | None = None,
        cuda_graph: bool | None = None,
        compile: bool = False,
        padding: Literal["left", "right"] = "left",
        check_every: int = 16,
    ) -> None:
        self.model = model
        self.device = model.output_weight.device
        self.pad_id = next((t for t in (tokenizer.pad_id, tokenizer.eos_id) if t is not None), 0)
        self.amp_dtype = amp_dtype
        self.cuda_graph = (self.device.type == "cuda") if cuda_graph is None else cuda_graph
        if self.cuda_graph and (self.device.type != "cuda" or model.tp_group is not None):
            raise ValueError("cuda_graph needs a CUDA model without vocab-parallel sharding")
        self.compile = compile
        self.padding = padding
        self.check_every = check_every
        self.replica: DecoderLM | None = None
        self.head_weight: torch.Tensor | None = None
        self._steps: dict[tuple[int, int], _DecodeStep] = {}  # graph path: by (batch, cache length), oldest first

    # --- weights -----------------------------------------------------------------------------------------
    def sync_weights(self) -> None:
        """Copy the live weights into the replica (graph path; built on first use). Matrices other than the
        embeddings take the autocast dtype, as autocast would cast them; the tied head gets its own copy."""
        live = self.model
        if self.replica is None:
            self.replica = build_model(live.config, device="meta")
            self.replica.to_empty(device=self.device)
            self.replica.requires_grad_(False).eval()
            dtype = self.amp_dtype or torch.float32
            for name, parameter in self.replica.named_parameters():
                if parameter.dim() >= 2 and not name.startswith("embeddings."):
                    parameter.data = parameter.data.to(dtype)
            self.head_weight = torch.empty_like(live.output_weight, dtype=dtype, device=self.device)
        source = dict(live.named_parameters())
        with torch.no_grad():
            for name, parameter in self.replica.named_parameters():
                value = source[name]
                parameter.copy_(value.full_tensor() if hasattr(value, "full_tensor") else value)
            assert self.head_weight is not None
            self.head_weight.copy_(self.replica.output_weight)

    # --- generation --------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], options: SamplingOptions,
                 generator: torch.Generator | None = None) -> list[Completion]:
        """One completion per prompt (repeat a prompt G times for a group). `generator` lives on the model's
        device (None: torch's default generator there). The live model's train/eval mode is left as found."""
        check_prompts(prompts, options, self.model)
        width = max(len(p) for p in prompts)
        length = width + options.max_new_tokens - 1
        if self.cuda_graph:
            self.sync_weights()
            model, head_weight = self.replica, self.head_weight
            length = -(-length // CACHE_ROUNDING) * CACHE_ROUNDING
        else:
            model, head_weight = self.model, None
        assert model is not None
        was_training = model.training
        model.eval()
        try:
            step = self._decode_step(model, head_weight, len(prompts), length)
            return self._generate(model, head_weight, step, prompts, options, generator, width)
        finally:
            model.train(was_training)

    def _decode_step(self, model: DecoderLM, head_weight: torch.Tensor | None, batch: int, length: int) -> _DecodeStep:
        """The decode step for this batch size and cache length: kept on the graph path (the last
        `KEPT_GRAPHS` shapes), fresh otherwise."""
        key = (batch, length)
        if key in self._steps:
            return self._steps[key]
        while len(self._steps) >= KEPT_GRAPHS:
            del self._steps[next(iter(self._steps))]  # free the oldest graph and cache first
        config = model.config
        kv_heads = config.num_heads if model.is_gpt2 else config.kv_heads
        dtype = self.amp_dtype or model.output_weight.dtype
        cache = KVCache(config.num_layers, batch, config.num_heads, kv_heads, length, config.head_dim, dtype,
                        self.device, uniform_columns=self.padding == "left")
        step = _DecodeStep(model, cache, head_weight, self.amp_dtype, self.cuda_graph, self.compile)
        if self.cuda_graph:
            self._steps[key] = step
        return step

    def _generate(self, model: DecoderLM, head_weight: torch.Tensor | None, step: _DecodeStep,
                  prompts: list[list[int]], options: SamplingOptions, generator: torch.Generator | None,
                  width: int) -> list[Completion]:
        device, batch, cache = self.device, len(prompts), step.cache
        lengths = torch.tensor([len(p) for p in prompts])
        tokens = torch.full((batch, width), self.pad_id, dtype=torch.int64)
        for row, prompt in enumerate(prompts):
            if self.padding == "left":
                tokens[row, width - len(prompt):] = torch.tensor(prompt)
            else:
                tokens[row, : len(prompt)] = torch.tensor(prompt)
        start = width - lengths if self.padding == "left" else torch.zeros_like(lengths)
        last = torch.full_like(lengths, width - 1) if self.padding == "left" else lengths - 1
        cache.start.copy_(start)
        columns = torch.arange(width).expand(batch, width).to(device)
        with autocast(device, self.amp_dtype):
            hidden = model.cached_hidden_states(tokens.to(device), cache, columns, width)
            logits = model.head_logits(hidden[torch.arange(batch, device=device), last.to(device)], head_weight).float()
        columns = (last + 1)[:, None].to(device)
        stops = torch.tensor(options.stop_tokens, dtype=torch.int64, device=device)
        drawn = torch.full((batch, options.max_new_tokens), self.pad_id, dtype=torch.int64, device=device)
        logprobs = torch.zeros(batch, options.max_new_tokens, dtype=torch.float32, device=device)
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        for index in range(options.max_new_tokens):
            choice, logprob = pick_tokens(logits, options, generator)
            drawn[:, index] = choice.masked_fill(done, self.pad_id)
            logprobs[:, index] = logprob.masked_fill(done, 0.0)
            if len(options.stop_tokens):
                done |= torch.isin(choice, stops)
            if index + 1 == options.max_new_tokens:
                break
            if len(options.stop_tokens) and (index + 1) % self.check_every == 0 and bool(done.all()):
                break
            logits = step(choice[:, None], columns)
            columns += 1
        return _completions(drawn.cpu(), logprobs.cpu(), set(options.stop_tokens))


def _completions(drawn: torch.Tensor, logprobs: torch.Tensor, stops: set[int]) -> list[Completion]:
    """Cut each row after its first stop token (or at the budget)."""
    out = []
    for row_tokens, row_logprobs in zip(drawn.tolist(), logprobs.tolist()):
        end = next((i + 1 for i, token in enumerate(row_tokens) if token in stops), None)
        stopped = end is not None
        end = end or len(row_tokens)
        out.append(Completion(row_tokens[:end], row_logprobs[:end], stopped))
    return out


def generate(
    model: DecoderLM,
    prompts: list[list[int]],
    options: SamplingOptions,
    tokenizer: TokenizerLike,
    generator: torch.Generator | None = None,
    amp_dtype: torch.dtype | None = None,
) -> list[Completion]:
    """One-off generation (a fresh `Generator`: eager, no graph); keep a `Generator` to reuse graphs."""
    return Generator(model, tokenizer, amp_dtype, cuda_graph=False).generate(prompts, options, generator)
