"""Batched generation with the training decoder and a static KV cache.

One prefill forward writes the prompts' keys and values into a preallocated cache (fastlm/layers/kv_cache.py)
and gives the first token's logits; then each decode step feeds the B last tokens, writes one cache column
and computes the head at that position only, then picks and records the next tokens (`DecodeState`).
Sampling, stop tokens and per-row finishing stay on the device; the host reads the device once every
`check_every` steps (to end early when every row has stopped) and once at the end.

On CUDA (`cuda_graph=True`, the default there) the decode step runs on a bf16 replica of the weights
(linear weights and the head in the autocast dtype, embeddings and norms as trained: the training forward's
numerics) and is captured once in a `torch.cuda.CUDAGraph`, optionally after `torch.compile` (one graph:
the 24 layers, the attention's block mask and the sampling tail); the host copies the rows' sequence seeds
once per generation and then launches one replay per token. Attention in the captured step is FlexAttention
decode, which reads only the cache blocks written so far. A `Generator` kept across calls reuses the graph while the
batch size, cache length and sampling options stay the same and only copies the live weights into the
replica (`sync_weights`: before every call, or only when the caller says with `sync_on_generate=False`, as
the rollout backend does, backend.py). On CPU, or without the graph, the live model runs eagerly under the
given autocast, through the same step.

Prompts are left-padded by default (every row writes the same cache column each step); `padding="right"`
keeps each row at its own columns. Both give the same tokens.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal, Protocol

import torch

from fastlm.generation.cuda_graph import capture
from fastlm.generation.sampling import SamplingOptions, draw_uniforms, pick_tokens, sequence_seeds
from fastlm.layers.kv_cache import DecodeAttention, KVCache
from fastlm.layers.moe import RoutingRecorder, attach_recorder
from fastlm.lora.attach import merged_weights
from fastlm.models.decoder import DecoderLM, build_model
from fastlm.system.device import autocast
from fastlm.system.errors import first_line

CACHE_ROUNDING = 128  # graph path: cache lengths are rounded up to this, so a graph serves nearby prompt widths
KEPT_GRAPHS = 2  # graph path: decode steps kept per Generator (e.g. the rollouts' and the greedy eval's)


class TokenizerLike(Protocol):
    pad_id: int | None
    eos_id: int | None

    @property
    def vocab_size(self) -> int: ...


@dataclass(frozen=True)
class Completion:
    """Sampled tokens (the stop token included when one was drawn) and their log-probs under the sampling
    distribution (after the head's transform, temperature, top-k and top-p; greedy: the untempered softmax),
    which spans the ids the tokenizer can decode (`DecodeState`). `policy_version`: the version of the weights
    it was sampled with (the backend's last `sync_weights`). `routing` (prompt + tokens, M, k) int16: each
    input token's experts in the M MoE layers when the generator records them (routing replay), -1 for the
    last token (never fed back)."""

    tokens: list[int]
    logprobs: list[float]
    stopped: bool
    policy_version: int = 0
    routing: torch.Tensor | None = None


def check_prompts(prompts: list[list[int]], options: SamplingOptions, model: DecoderLM,
                  budgets: list[int] | None = None) -> None:
    """Clear errors for what would otherwise fail inside the forward (or silently overrun positions)."""
    if not prompts:
        raise ValueError("generation needs at least one prompt")
    if budgets is not None and (len(budgets) != len(prompts) or not all(
            1 <= b <= options.max_new_tokens for b in budgets)):
        raise ValueError(f"budgets must be one per prompt, each in [1, max_new_tokens={options.max_new_tokens}]")
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


@dataclass
class DecodeState:
    """The device buffers one generation updates per token (static addresses on the graph path).

    `tokens`/`columns` (B, 1): the last drawn token, the next step's input, and its cache column;
    `drawn`/`logprobs` (B, N): what was picked (pad / 0 after a row's stop token); `done` (B,): the row
    has drawn a stop token or its budget (`budgets` (B,): its most draws, max_new_tokens unless the caller
    gives per-row budgets); `index` (): the next slot of `drawn`, also the draw's index in each row's
    completion; `seeds` (B,): each row's sequence seed (sampling.py; None when greedy); `stops` (n,): the
    stop tokens. V is the drawable vocab: the tokenizer's,
    when the model's is padded past it (checkpoints pad vocab to a multiple of 64 or 128), so the sampler
    never draws an id the tokenizer cannot decode (vLLM trims a padded vocab's logits the same way).
    """

    tokens: torch.Tensor
    columns: torch.Tensor
    drawn: torch.Tensor
    logprobs: torch.Tensor
    done: torch.Tensor
    budgets: torch.Tensor
    index: torch.Tensor
    seeds: torch.Tensor | None
    stops: torch.Tensor
    vocab: int

    @classmethod
    def empty(cls, batch: int, vocab: int, options: SamplingOptions, device: torch.device) -> DecodeState:
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        seeds = None if options.greedy else zeros(batch)
        stops = torch.tensor(options.stop_tokens, dtype=torch.int64, device=device)
        return cls(zeros(batch, 1), zeros(batch, 1), zeros(batch, options.max_new_tokens),
                   zeros(batch, options.max_new_tokens, dtype=torch.float32), zeros(batch, dtype=torch.bool),
                   zeros(batch), zeros(dtype=torch.int64), seeds, stops, vocab)

    @property
    def buffers(self) -> list[torch.Tensor]:
        return [t for t in (self.tokens, self.columns, self.drawn, self.logprobs, self.done, self.budgets, self.index, self.seeds)
                if t is not None]

    def reset(self, columns: torch.Tensor, pad_id: int, seeds: torch.Tensor, budgets: torch.Tensor | None = None) -> None:
        """Before a generation (or a turn): the first decode column, sequence seed and budget (None: the
        whole max_new_tokens) of each row, nothing drawn yet."""
        self.columns.copy_(columns)
        if budgets is None:
            self.budgets.fill_(self.drawn.shape[1])
        else:
            self.budgets.copy_(budgets)
        if self.seeds is not None:
            self.seeds.copy_(seeds)
        self.drawn.fill_(pad_id)
        self.logprobs.zero_()
        self.done.zero_()
        self.index.zero_()

    def record(self, logits: torch.Tensor, options: SamplingOptions, pad_id: int) -> None:
        """Pick the next tokens from (B, V) raw logits and write them into slot `index` (on the device)."""
        uniforms = None if self.seeds is None else draw_uniforms(self.seeds, self.index)
        choice, logprob = pick_tokens(logits[:, : self.vocab], options, uniforms)
        slot = self.index[None]
        self.drawn.index_copy_(1, slot, choice.masked_fill(self.done, pad_id)[:, None])
        self.logprobs.index_copy_(1, slot, logprob.masked_fill(self.done, 0.0)[:, None])
        if self.stops.numel():
            self.done |= (choice[:, None] == self.stops).any(dim=-1)
        self.done |= self.index + 1 >= self.budgets
        self.tokens.copy_(choice[:, None])
        self.index += 1


class _DecodeStep:
    """One decode step on fixed buffers: the B last tokens in, their keys and values into the cache, the
    next tokens picked and recorded in `state` (sampling included), optionally compiled as one graph and
    captured in a CUDA graph; the host only replays it."""

    def __init__(self, model: DecoderLM, cache: KVCache, state: DecodeState, options: SamplingOptions, pad_id: int,
                 head_weight: torch.Tensor | None, amp_dtype: torch.dtype | None, cuda_graph: bool,
                 compile: bool, recorder: RoutingRecorder | None = None) -> None:
        self.model, self.cache, self.state, self.options, self.pad_id = model, cache, state, options, pad_id
        self.head_weight, self.amp_dtype = head_weight, amp_dtype
        self.recorder = recorder  # routing replay: the MoE layers write each token's experts here (by cache column)
        attach_recorder(model.moe_layers, recorder)  # before a compile or capture: the graph holds the writes
        self.run = self.forward
        if compile:
            for buffer in cache.buffers + state.buffers:  # updated in place every step: not inputs to copy or guard on
                torch._dynamo.mark_static_address(buffer)
            self.run = torch.compile(self.forward, fullgraph=True, dynamic=False)
        self.graph: torch.cuda.CUDAGraph | None = None
        if cuda_graph:
            self.graph = capture(self.run, self._rewind)

    def forward(self) -> None:
        device, state = self.state.tokens.device, self.state
        context = autocast(device, self.amp_dtype) if self.amp_dtype is None else torch.autocast(
            device.type, dtype=self.amp_dtype, cache_enabled=False)  # no cast cache: a graph must not keep one
        with context:
            hidden = self.model.cached_hidden_states(state.tokens, self.cache, state.columns, self.cache.length)
            logits = self.model.head_logits(hidden[:, -1], self.head_weight)
        state.record(logits, self.options, self.pad_id)
        state.columns += 1

    def _rewind(self) -> None:
        """Warm-up and capture write column 0 and slot 0 (in range for any cache and budget)."""
        self.state.columns.zero_()
        self.state.index.zero_()

    def __call__(self) -> None:
        if self.graph is None:
            self.run()
        else:
            self.graph.replay()


class Generator:
    """Reusable generation engine for one model (see the module docstring).

    `cuda_graph=None` means "on when the model is on CUDA"; `compile=True` runs the decode step through
    torch.compile first (worth it for many small kernels; costs a compile per new shape and sampling
    setting). `decode_attention=None` means FlexAttention decode on the graph path, SDPA otherwise
    (fastlm/layers/kv_cache.py; eager FlexAttention would be compiled on first use, a cost one-off calls skip).
    If building a compiled or FlexAttention step fails (a compiler error shows up in its warm-up), one line
    says so and the generator continues without compile and with SDPA, as the trainer does for its blocks.
    `sync_on_generate=False`: the graph path's replica is refreshed only by `sync_weights` (the caller's).
    `record_routing=True` (an MoE model; rl.routing_replay): each completion carries its tokens' experts.
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
        decode_attention: DecodeAttention | None = None,
        sync_on_generate: bool = True,
        record_routing: bool = False,
    ) -> None:
        self.model = model
        self.device = model.output_weight.device
        self.pad_id = next((t for t in (tokenizer.pad_id, tokenizer.eos_id) if t is not None), 0)
        self.vocab = min(model.config.vocab_size, tokenizer.vocab_size)  # the ids the sampler may draw
        self.amp_dtype = amp_dtype
        self.cuda_graph = (self.device.type == "cuda") if cuda_graph is None else cuda_graph
        if self.cuda_graph and (self.device.type != "cuda" or model.tp_group is not None):
            raise ValueError("cuda_graph needs a CUDA model without vocab-parallel sharding")
        self.compile = compile
        self.padding = padding
        self.check_every = check_every
        self.sync_on_generate = sync_on_generate
        self.record_routing = record_routing and bool(model.moe_layers)
        self.decode_attention: DecodeAttention = decode_attention or ("flex" if self.cuda_graph else "sdpa")
        self.replica: DecoderLM | None = None
        self.head_weight: torch.Tensor | None = None
        self._steps: dict[tuple[int, int, SamplingOptions], _DecodeStep] = {}  # graph path: oldest first

    # --- weights -----------------------------------------------------------------------------------------
    def sync_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        """Copy the live weights (or `weights`: (name, tensor) of every base parameter, as `merged_weights` gives
        them) into the replica (graph path; built on first use). Matrices other than the embeddings take the
        autocast dtype, as autocast would cast them; the tied head gets its own copy. LoRA adapters are merged
        in (W + scale B A): decoding runs at the full model's speed."""
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
        replica = dict(self.replica.named_parameters())
        with torch.no_grad():
            for name, value in merged_weights(live) if weights is None else weights:
                replica[name].copy_(value)
            assert self.head_weight is not None
            self.head_weight.copy_(self.replica.output_weight)

    def sync_before_decoding(self) -> None:
        """Graph path, before a generation: the replica takes the live weights now, or (`sync_on_generate=False`)
        holds what the caller's last `sync_weights` copied."""
        if self.sync_on_generate:
            self.sync_weights()
        elif self.replica is None:
            raise RuntimeError("this Generator was built with sync_on_generate=False: call sync_weights() first")

    # --- generation --------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], options: SamplingOptions, generator: torch.Generator | None = None,
                 budgets: list[int] | None = None) -> list[Completion]:
        """One completion per prompt (repeat a prompt G times for a group). `generator` lives on the model's
        device (None: torch's default generator there). `budgets` caps each row's draws below max_new_tokens
        (benchmarks force lengths with it). The live model's train/eval mode is left as found."""
        check_prompts(prompts, options, self.model, budgets)
        width = max(len(p) for p in prompts)
        length = width + options.max_new_tokens - 1
        if self.cuda_graph:
            self.sync_before_decoding()
            model, head_weight = self.replica, self.head_weight
            length = -(-length // CACHE_ROUNDING) * CACHE_ROUNDING
        else:
            model, head_weight = self.model, None
        assert model is not None
        was_training = model.training
        model.eval()
        try:
            step = self._decode_step(model, head_weight, len(prompts), length, options)
            attach_recorder(model.moe_layers, step.recorder)
            return self._generate(model, head_weight, step, prompts, generator, width, budgets)
        finally:
            attach_recorder(model.moe_layers, None)  # a training forward records nothing
            model.train(was_training)

    def _decode_step(self, model: DecoderLM, head_weight: torch.Tensor | None, batch: int, length: int,
                     options: SamplingOptions) -> _DecodeStep:
        """The decode step for this batch size, cache length and sampling: kept on the graph path (the last
        `KEPT_GRAPHS` of them), fresh otherwise."""
        key = (batch, length, options)
        if key in self._steps:
            return self._steps[key]
        while len(self._steps) >= KEPT_GRAPHS:
            del self._steps[next(iter(self._steps))]  # free the oldest graph and cache first
        try:
            step = self._new_step(model, head_weight, batch, length, options)
        except Exception as error:  # noqa: BLE001 - a compiler failure means "decode the plain way"
            if not (self.compile or self.decode_attention == "flex"):
                raise
            print(f"fastlm: building the decode step (compile={self.compile}, {self.decode_attention} attention) "
                  f"failed ({first_line(error)}); generating without compile, with SDPA", file=sys.stderr, flush=True)
            self.compile, self.decode_attention = False, "sdpa"
            step = self._new_step(model, head_weight, batch, length, options)
        if self.cuda_graph:
            self._steps[key] = step
        return step

    def _new_step(self, model: DecoderLM, head_weight: torch.Tensor | None, batch: int, length: int,
                  options: SamplingOptions) -> _DecodeStep:
        """A fresh cache, state and step (compiling and capturing it, on those paths)."""
        config = model.config
        dtype = self.amp_dtype or model.output_weight.dtype
        recurrent = [config.recurrent_state(layer) for layer in range(config.num_layers)]
        kv_heads, key_width, value_width = config.kv_cache_shape()
        cache = KVCache(config.num_layers, batch, config.num_heads, kv_heads, length, key_width, dtype, self.device,
                        uniform_columns=self.padding == "left", decode_attention=self.decode_attention,
                        recurrent=recurrent, value_dim=value_width,
                        layer_shapes=[config.layer_kv_shape(layer) for layer in range(config.num_layers)],
                        kv_sources=[config.kv_source(layer) for layer in range(config.num_layers)])
        state = DecodeState.empty(batch, self.vocab, options, self.device)
        cache.frozen = state.done  # a finished row's steps leave linear-attention states alone
        recorder = None
        if self.record_routing:
            shape = (batch, length, len(model.moe_layers), model.moe_layers[0].top_k)
            recorder = RoutingRecorder(torch.full(shape, -1, dtype=torch.int16, device=self.device), state.columns)
        return _DecodeStep(model, cache, state, options, self.pad_id, head_weight, self.amp_dtype, self.cuda_graph,
                           self.compile, recorder)

    def _generate(self, model: DecoderLM, head_weight: torch.Tensor | None, step: _DecodeStep,
                  prompts: list[list[int]], generator: torch.Generator | None, width: int,
                  budgets: list[int] | None = None) -> list[Completion]:
        device, batch, cache, state, options = self.device, len(prompts), step.cache, step.state, step.options
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
        state.reset((last + 1)[:, None], self.pad_id, sequence_seeds(batch, generator, device),
                    None if budgets is None else torch.tensor(budgets, device=device))
        columns = torch.arange(width).expand(batch, width).to(device)
        cache.ends.copy_(last + 1)  # right padding: the prompt's padding is not part of a recurrent state
        if step.recorder is not None:
            step.recorder.buffer.fill_(-1)
            step.recorder.columns = columns
        with autocast(device, self.amp_dtype):
            hidden = model.cached_hidden_states(tokens.to(device), cache, columns, width, last.to(device))
            logits = model.head_logits(hidden[torch.arange(batch, device=device), last.to(device)], head_weight)
        cache.ends.fill_(cache.length)
        if step.recorder is not None:
            step.recorder.columns = state.columns  # the decode steps' (the graph's static buffer)
        state.record(logits, options, self.pad_id)
        may_end = len(options.stop_tokens) or budgets is not None
        rebuilds = {position - int(n) + 1 for position in model.rope_switch_positions for n in lengths}
        for index in range(1, options.max_new_tokens):
            if may_end and index % self.check_every == 0 and bool(state.done.all()):
                break
            if index in rebuilds:
                self._rebuild_step(model, head_weight, step, tokens.to(device), last.to(device), index)
            else:
                step()
        completions = _completions(state.drawn.cpu(), state.logprobs.cpu(), set(options.stop_tokens), budgets)
        if step.recorder is None:
            return completions
        return recorded_routing(completions, step.recorder.buffer.cpu(), start.tolist(), lengths.tolist())

    def _rebuild_step(self, model: DecoderLM, head_weight: torch.Tensor | None, step: _DecodeStep,
                      prompts: torch.Tensor, last: torch.Tensor, index: int) -> None:
        """Decode step `index` as a forward over every token so far, rewriting the whole cache: a row's input
        position reaches a `rope_switch_positions` entry (longrope's original context), past which its keys take
        other frequencies, so the cached ones are stale (transformers' Phi-3 `generate` recomputes the same way).
        `prompts` (B, width) is the prefill's input, `last` (B,) each row's last prompt column."""
        state, batch = step.state, prompts.shape[0]
        width = prompts.shape[1] + index
        tokens = torch.cat((prompts, prompts.new_full((batch, index), self.pad_id)), dim=1)
        tokens.scatter_(1, last[:, None] + 1 + torch.arange(index, device=tokens.device), state.drawn[:, :index])
        columns = torch.arange(width, device=tokens.device).expand(batch, width)
        if step.recorder is not None:  # the rewrite routes every token again: its routing is recorded
            step.recorder.columns = columns
        with autocast(self.device, self.amp_dtype):
            hidden = model.cached_hidden_states(tokens, step.cache, columns, width, last + index)
            logits = model.head_logits(hidden[torch.arange(batch, device=tokens.device), last + index], head_weight)
        if step.recorder is not None:
            step.recorder.columns = state.columns
        state.record(logits, step.options, self.pad_id)
        state.columns += 1


def _completions(drawn: torch.Tensor, logprobs: torch.Tensor, stops: set[int],
                 budgets: list[int] | None = None) -> list[Completion]:
    """Cut each row after its first stop token (or at its budget)."""
    out = []
    for row, (row_tokens, row_logprobs) in enumerate(zip(drawn.tolist(), logprobs.tolist())):
        budget = len(row_tokens) if budgets is None else budgets[row]
        end = next((i + 1 for i, token in enumerate(row_tokens[:budget]) if token in stops), None)
        stopped = end is not None
        end = end or budget
        out.append(Completion(row_tokens[:end], row_logprobs[:end], stopped))
    return out


def recorded_routing(completions: list[Completion], buffer: torch.Tensor, starts: list[int],
                     lengths: list[int]) -> list[Completion]:
    """Each completion with its recorded experts (routing replay): `buffer` (B, C, M, k) by cache column, row r's
    prompt at columns starts[r] .. + lengths[r] - 1 and its i-th sampled token fed back at the column after
    them + i; the last sampled token was never fed back (-1: the trainer's router picks)."""
    out = []
    for row, completion in enumerate(completions):
        begin, fed = starts[row], lengths[row] + len(completion.tokens) - 1
        routing = torch.cat([buffer[row, begin:begin + fed], buffer.new_full((1, *buffer.shape[2:]), -1)])
        out.append(replace(completion, routing=routing))
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
