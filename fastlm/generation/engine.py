"""Continuous-batching generation on a paged KV cache: the rollout engine.

A request is a list of sequences (one per prompt, a group's G samples being G requests of one prompt).
The engine keeps at most `max_slots` sequences decoding at once; between chunks of `check_every` decode
steps it reads the chunk's tokens back, retires the sequences that stopped (a stop token or their budget)
and admits waiting ones into the free slots, in request order, so a slot never idles while work waits.
Completions come back in request order.

- Prefix sharing: the first sequence of a prompt (its leader) is prefilled; the prompt's blocks and its
  last logits are kept on a `_Prompt` until every sibling has started. A sibling shares the prompt's full
  blocks (reference counts), copies its partial last block, and draws its first token from the kept
  logits: no prefill at all. Turns appended later (multi-turn) go to the sequence's own blocks.
- Memory: the paged cache (paged_cache.py) holds `num_blocks` blocks, sized from a byte budget
  (`kv_cache_memory_gib`, else a fraction of the free device memory; on CPU the request's worst case).
  Blocks are taken as tokens arrive. A sequence is admitted only while one free block per running
  sequence remains; when a chunk's blocks run out anyway, the newest sequence is preempted: its blocks
  are freed and it waits at the head of the queue, to be recomputed (its tokens so far prefilled again).
  Draws depend only on the sequence's seed and draw index (sampling.py), so a recomputed sequence draws
  what it would have. Nothing is dropped; a sequence that could not fit an empty cache is refused up front.
- Sliding-window layers release a sequence's blocks once they fall out of the window.
- The decode step (slot_step.py) runs on the slot batch padded to a bucket (`max_slots`, / 4, / 16, ...),
  one CUDA graph per bucket on the bf16 replica of the static generator (FlexAttention paged decode).

Seeds: one per sequence, drawn from the caller's generator in request order (per turn in a session),
exactly as the static generator draws them per row, so both give the same tokens for the same (prompt,
sample) pairs up to the rounding of differently shaped matmuls.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from dataclasses import dataclass, field

import torch

from fastlm.generation.generator import Completion, Generator, check_prompts
from fastlm.generation.paged_cache import SCRATCH, PagedKVCache
from fastlm.generation.sampling import SamplingOptions, draw_uniforms, pick_tokens, sequence_seeds
from fastlm.generation.slot_step import SlotState, SlotStep
from fastlm.layers.attention import Attention
from fastlm.layers.moe import RoutingRecorder, attach_recorder
from fastlm.models.decoder import DecoderLM
from fastlm.system.device import autocast
from fastlm.system.errors import first_line

DEFAULT_BLOCK_SIZE = 64  # tokens per block on the graph path: FlexAttention decode's key block on H100
SMALLEST_BLOCK_SIZE = 16  # tokens per block elsewhere (eager, CPU)
FREE_MEMORY_FRACTION = 0.3  # the cache's share of the free device memory when no budget is given
PREFILL_TOKENS = 4096  # the most (padded) tokens one prefill forward takes (its SDPA mask: 2 B x tokens x cache)


def engine_supports(model: DecoderLM) -> bool:
    """Whether the engine can serve this model: every layer is plain attention over a key/value cache (no score
    softcap or sinks), of one key/value shape, and the head is not vocab-parallel (other families, e.g.
    recurrent-state or latent layers, Gemma 2's softcap, GPT-OSS's sinks, Gemma 4's wider global layers and shared
    KV, take the static path)."""
    shape = model.config.kv_cache_shape()[:2]
    return model.tp_group is None and all(
        type(getattr(b, "attn", None)) is Attention and b.attn.softcap is None and b.attn.sinks is None
        and model.config.layer_kv_shape(layer) == shape and model.config.kv_source(layer) == layer
        for layer, b in enumerate(model.blocks))


@dataclass
class _Prompt:
    """A prompt its sequences share: its blocks per window group and last logits, once the leader ran."""

    tokens: list[int]
    waiting: int  # sequences of this prompt that have not started yet
    blocks: list[list[int]] | None = None
    logits: torch.Tensor | None = None
    leader_chosen: bool = False
    routing: torch.Tensor | None = None  # routing replay: the leader's record of the prompt's tokens


@dataclass(eq=False)  # identity: the scheduler's lists hold sequences, never compare them by value
class _Sequence:
    index: int  # its row in the request or session
    tokens: list[int]  # cached or to cache: prompt, earlier turns, this turn's draws
    turn_start: int  # where this turn's draws begin in `tokens`
    seed: int
    budget: int  # draws allowed this turn
    prompt: _Prompt | None = None  # until it has taken its share (or been preempted)
    blocks: list[list[int]] = field(default_factory=list)  # per window group, logical order (SCRATCH: released)
    cached: int = 0  # tokens whose keys and values are in the cache
    logprobs: list[float] = field(default_factory=list)
    stopped: bool = False
    admitted: int = -1  # admission order (preemption takes the newest)
    routing: torch.Tensor | None = None  # routing replay: (prompt + budget, M, k) experts by position, -1 unrouted

    @property
    def drawn(self) -> int:
        return len(self.tokens) - self.turn_start

    @property
    def done(self) -> bool:
        return self.stopped or self.drawn >= self.budget

    def completion(self) -> Completion:
        routing = None if self.routing is None else self.routing[: len(self.tokens)].clone()
        return Completion(self.tokens[self.turn_start:], list(self.logprobs), self.stopped, routing=routing)


class Engine:
    """Continuous batching with prefix sharing on a paged cache, for the model of a static `Generator`
    (whose bf16 replica, weight sync, padding id and drawable vocab it uses; see the module docstring).

    `num_blocks` sizes the cache directly (tests); else `kv_cache_memory_gib`, else a fraction of the free
    CUDA memory at first use (kept across calls: the graphs read its pools), else (CPU) each request's worst
    case."""

    def __init__(self, generator: Generator, max_slots: int = 256, block_size: int | None = None,
                 kv_cache_memory_gib: float | None = None, num_blocks: int | None = None,
                 check_every: int | None = None, prefill_tokens: int = PREFILL_TOKENS) -> None:
        if not engine_supports(generator.model):
            raise ValueError("the engine serves plain-attention models without a vocab-parallel head")
        self.generator, self.max_slots, self.prefill_tokens = generator, max_slots, prefill_tokens
        # decode steps between host reads: longer chunks hide the host's bookkeeping behind the graph replays,
        # shorter ones free finished slots sooner (a finished row idles for the rest of its chunk)
        self.check_every = check_every or (32 if generator.cuda_graph else 8)
        self.block_size = block_size or (DEFAULT_BLOCK_SIZE if generator.cuda_graph else SMALLEST_BLOCK_SIZE)
        self.kv_cache_memory_gib, self.num_blocks = kv_cache_memory_gib, num_blocks
        self.cache: PagedKVCache | None = None
        self.steps: dict[tuple[int, SamplingOptions], SlotStep] = {}
        self.graphs = generator.cuda_graph  # off after a failed flex/compiled step: SDPA must read live widths
        self.states: dict[SamplingOptions, SlotState] = {}
        self.peak_blocks: list[int] = []  # per window group, in the last request
        self.prefilled_tokens = 0  # tokens written by prefills in the last request (shared prompts count once)
        self.admissions = 0  # sequence starts in the last request (a preempted one starts again)
        self.epoch = 0  # bumped by every request: an older session's blocks are gone
        self.record = generator.record_routing  # routing replay: each token's experts by sequence position

    # --- the cache -----------------------------------------------------------------------------------
    @property
    def model(self) -> DecoderLM:
        generator = self.generator
        model = generator.replica if generator.cuda_graph else generator.model
        assert model is not None
        return model

    def _block_bytes(self) -> int:
        config, dtype = self.generator.model.config, self.generator.amp_dtype or self.generator.model.output_weight.dtype
        return PagedKVCache.block_bytes(config.num_layers, config.kv_heads, config.head_dim, self.block_size, dtype)

    def _blocks_for(self, sequences: list[_Sequence]) -> int:
        """The cache size: the configured one, or what this request needs without waiting (CPU)."""
        if self.num_blocks is not None:
            return self.num_blocks
        if self.kv_cache_memory_gib is not None:
            return int(self.kv_cache_memory_gib * 2**30) // self._block_bytes()
        if self.generator.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.generator.device)
            return int(free * FREE_MEMORY_FRACTION) // self._block_bytes()
        return 1 + sum(math.ceil((len(s.tokens) + s.budget) / self.block_size) + 1 for s in sequences)

    def _ensure_cache(self, sequences: list[_Sequence]) -> PagedKVCache:
        """The cache, (re)built when none fits this request; every block is free again (a new request)."""
        model, generator = self.model, self.generator
        blocks = self._blocks_for(sequences)
        if self.cache is None or (self.cache.num_blocks < blocks and self.generator.device.type != "cuda"):
            config = model.config
            self.steps.clear()
            self.states.clear()
            self.cache = PagedKVCache(
                [group for group, _ in model.layer_kinds], list(model.windows), config.num_heads, config.kv_heads,
                config.head_dim, self.block_size, blocks, generator.amp_dtype or model.output_weight.dtype,
                generator.device, decode_attention="flex" if generator.decode_attention == "flex" else "sdpa")
        cache = self.cache
        for group, allocator in enumerate(cache.allocators):
            cache.allocators[group] = type(allocator)(cache.num_blocks)
        self.peak_blocks = [0] * len(cache.allocators)
        self.prefilled_tokens = self.admissions = 0
        self.epoch += 1
        biggest = max(math.ceil((len(s.tokens) + s.budget) / self.block_size) for s in sequences)
        if biggest > cache.num_blocks - 1:
            raise ValueError(
                f"a sequence of up to {max(len(s.tokens) + s.budget for s in sequences)} tokens needs {biggest} "
                f"blocks of {self.block_size}, more than the paged KV cache holds ({cache.num_blocks - 1}); raise "
                f"rl.backend.kv_cache_memory_gib or lower rl.max_new_tokens")
        return cache

    def peak_bytes(self) -> int:
        """KV bytes of the most blocks held at once in the last request (every window group's layers)."""
        assert self.cache is not None
        per_layer = self._block_bytes() // self.generator.model.config.num_layers
        return sum(peak * per_layer * len(self.cache.layers_in(group)) for group, peak in enumerate(self.peak_blocks))

    # --- requests ------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], options: SamplingOptions, generator: torch.Generator | None = None,
                 budgets: list[int] | None = None) -> list[Completion]:
        """One completion per prompt, in order (identical prompts share their prefill and blocks); `budgets`
        caps each sequence's draws below options.max_new_tokens (benchmarks force lengths with it)."""
        check_prompts(prompts, options, self.generator.model, budgets)
        budgets = budgets or [options.max_new_tokens] * len(prompts)
        seeds = sequence_seeds(len(prompts), generator, self.generator.device).tolist()
        shared: dict[tuple[int, ...], _Prompt] = {}
        sequences = []
        for index, (prompt, seed, budget) in enumerate(zip(prompts, seeds, budgets)):
            entry = shared.setdefault(tuple(prompt), _Prompt(list(prompt), 0))
            entry.waiting += 1
            sequences.append(_Sequence(index, list(prompt), len(prompt), seed, budget, entry,
                                       routing=self._routing_record(len(prompt) + budget)))
        with self._decoding():
            self._ensure_cache(sequences)
            self._run(sequences, options, keep=False)
        return [s.completion() for s in sequences]

    def session(self, options: SamplingOptions, limit: int) -> EngineSession:
        if self.record:
            raise ValueError("the engine records routing for single-turn requests; multi-turn sessions do not")
        return EngineSession(self, options, limit)

    def _routing_shape(self) -> tuple[int, int]:
        """(MoE layers, k) of a routing record."""
        layers = self.model.moe_layers
        return len(layers), layers[0].top_k

    def _routing_record(self, length: int) -> torch.Tensor | None:
        """A sequence's empty routing record of `length` positions on the host (None: not recording)."""
        return torch.full((length, *self._routing_shape()), -1, dtype=torch.int16) if self.record else None

    def _decoding(self) -> _Decoding:
        return _Decoding(self)

    # --- scheduling ----------------------------------------------------------------------------------
    def _run(self, sequences: list[_Sequence], options: SamplingOptions, keep: bool,
             idle: list[_Sequence] | None = None) -> None:
        """Decode every sequence to its stop or budget; `keep`: finished ones keep their blocks (a session's
        next turn), held in `idle` (preempted first when blocks run out)."""
        idle = [] if idle is None else idle
        for sequence in sequences:
            sequence.blocks = sequence.blocks or [[] for _ in self.model.windows]
        waiting: deque[_Sequence] = deque(s for s in sequences if not s.done)
        running: list[_Sequence] = []
        while waiting or running:
            admitted = self._admit(waiting, running, idle, options)
            if not running and not admitted:
                raise RuntimeError("no waiting sequence fits the empty paged cache (the size check should refuse it)")
            running = self._retire(running, idle, keep)
            if not running:
                continue
            self._reserve(running, waiting, idle)
            self._decode(running, options)
            running = self._retire(running, idle, keep)

    def _retire(self, running: list[_Sequence], idle: list[_Sequence], keep: bool) -> list[_Sequence]:
        for sequence in running:
            if sequence.done:
                if keep:
                    idle.append(sequence)
                else:
                    self._release(sequence)
        return [s for s in running if not s.done]

    def _need(self, sequence: _Sequence) -> int:
        """Blocks (in the hungriest group) a sequence takes when it starts."""
        prompt = sequence.prompt
        if prompt is not None and prompt.leader_chosen:
            return 1 if len(prompt.tokens) % self.block_size else 0
        wanted = math.ceil(len(sequence.tokens) / self.block_size)
        return max(wanted - len(blocks) for blocks in sequence.blocks)

    def _admit(self, waiting: deque[_Sequence], running: list[_Sequence], idle: list[_Sequence],
               options: SamplingOptions) -> int:
        """Start waiting sequences in order while slots and blocks last (one free block kept per running
        sequence): leaders and preempted or continued sequences are prefilled (batched), then siblings take
        their prompt's shares. Returns how many started."""
        assert self.cache is not None
        allocators = self.cache.allocators
        prefill, siblings = [], []
        taken = 0  # blocks the sequences started in this round will take
        while waiting and len(running) + len(prefill) + len(siblings) < self.max_slots:
            sequence = waiting[0]
            need = self._need(sequence)
            headroom = len(running) + len(prefill) + len(siblings)
            if any(a.available - taken - need < headroom for a in allocators):
                if headroom or not self._evict(idle, waiting):  # alone: make room from idle sequences first
                    break
                continue
            waiting.popleft()
            taken += need
            self.admissions += 1
            sequence.admitted = self.admissions
            if sequence.prompt is not None and sequence.prompt.leader_chosen:
                siblings.append(sequence)
            else:
                if sequence.prompt is not None:
                    sequence.prompt.leader_chosen = True
                prefill.append(sequence)
        if prefill:
            self._prefill(prefill, options)
        if siblings:
            self._start_siblings(siblings, options)
        running.extend(prefill + siblings)
        return len(prefill) + len(siblings)

    def _evict(self, idle: list[_Sequence], waiting: deque[_Sequence]) -> bool:
        """Free blocks held by idle session sequences, then by prompts kept for waiting siblings; whether
        anything was freed (the caller checks again)."""
        if idle:
            self._preempt(idle.pop(), None)
            return True
        for sequence in waiting:
            prompt = sequence.prompt
            if prompt is not None and prompt.blocks is not None:
                self._drop_prompt(prompt)
                for other in waiting:
                    if other.prompt is prompt:
                        other.prompt = None
                return True
        return False

    def _drop_prompt(self, prompt: _Prompt) -> None:
        assert self.cache is not None and prompt.blocks is not None
        for allocator, blocks in zip(self.cache.allocators, prompt.blocks):
            for block in blocks:
                allocator.release(block)
        prompt.blocks, prompt.logits = None, None

    def _release(self, sequence: _Sequence) -> None:
        assert self.cache is not None
        for allocator, blocks in zip(self.cache.allocators, sequence.blocks):
            for block in blocks:
                allocator.release(block)
            blocks.clear()

    def _preempt(self, sequence: _Sequence, waiting: deque[_Sequence] | None) -> None:
        """Free a sequence's blocks; it will be recomputed from its tokens (a waiting one at the queue's head)."""
        self._release(sequence)
        sequence.cached, sequence.prompt = 0, None
        if waiting is not None:
            waiting.appendleft(sequence)

    def _grow(self, sequence: _Sequence, columns: int) -> bool:
        """Give the sequence blocks for its first `columns` columns in every group; False if out of blocks."""
        assert self.cache is not None
        wanted = math.ceil(columns / self.block_size)
        for allocator, blocks in zip(self.cache.allocators, sequence.blocks):
            while len(blocks) < wanted:
                if not allocator.available:
                    return False
                blocks.append(allocator.allocate())
        self._note_peak()
        return True

    def _note_peak(self) -> None:
        assert self.cache is not None
        self.peak_blocks = [max(p, a.used) for p, a in zip(self.peak_blocks, self.cache.allocators)]

    def _reserve(self, running: list[_Sequence], waiting: deque[_Sequence], idle: list[_Sequence]) -> None:
        """Blocks for the next chunk's writes of every running sequence; out of blocks: free idle sequences,
        kept prompts, then preempt the newest running one (recomputed later)."""
        for sequence in sorted(running, key=lambda s: s.admitted):
            writes = min(self.check_every, sequence.budget - sequence.drawn)
            while sequence in running and not self._grow(sequence, len(sequence.tokens) - 1 + writes):
                if self._evict(idle, waiting):
                    continue
                victim = max(running, key=lambda s: s.admitted)
                running.remove(victim)
                self._preempt(victim, waiting)

    def _release_window(self, sequence: _Sequence) -> None:
        """Sliding-window groups: release the blocks no later query of the sequence can see."""
        assert self.cache is not None
        following = len(sequence.tokens) - 1  # the next column written
        for group, window in enumerate(self.cache.windows):
            if window is None:
                continue
            blocks, allocator = sequence.blocks[group], self.cache.allocators[group]
            for logical in range(max(following - window + 1, 0) // self.block_size):
                if blocks[logical] != SCRATCH:
                    allocator.release(blocks[logical])
                    blocks[logical] = SCRATCH

    # --- device work ---------------------------------------------------------------------------------
    def _tables(self, sequences: list[_Sequence]) -> list[torch.Tensor]:
        """(n, W) block tables per window group (W: the longest), zero-padded."""
        assert self.cache is not None
        tables = []
        for group in range(len(self.cache.windows)):
            longest = max(1, max(len(s.blocks[group]) for s in sequences))
            rows = [s.blocks[group] + [SCRATCH] * (longest - len(s.blocks[group])) for s in sequences]
            tables.append(torch.tensor(rows, dtype=torch.int64).to(self.generator.device))
        return tables

    def _draw(self, sequences: list[_Sequence], logits: torch.Tensor, options: SamplingOptions) -> None:
        """Each sequence's next token from its row of (n, V) logits, with its own seed and draw index."""
        device = logits.device
        uniforms = None
        if not options.greedy:
            seeds = torch.tensor([s.seed for s in sequences], device=device)
            steps = torch.tensor([s.drawn for s in sequences], device=device)
            uniforms = draw_uniforms(seeds, steps)
        choice, logprob = pick_tokens(logits[:, : self.generator.vocab], options, uniforms)
        stops = set(options.stop_tokens)
        for sequence, token, value in zip(sequences, choice.tolist(), logprob.tolist()):
            sequence.tokens.append(token)
            sequence.logprobs.append(value)
            sequence.stopped = token in stops

    def _prefill(self, sequences: list[_Sequence], options: SamplingOptions) -> None:
        """Write each sequence's uncached tokens and draw its next token, in forwards of at most
        `prefill_tokens` padded tokens (a longer sequence, e.g. a recomputed one, writes its leading chunks
        alone first); a leader leaves its prompt's blocks and logits to its siblings."""
        for sequence in sequences:
            grown = self._grow(sequence, len(sequence.tokens))
            assert grown, "admission checked the blocks"
            while len(sequence.tokens) - sequence.cached > self.prefill_tokens:
                self._write([sequence], [sequence.cached + self.prefill_tokens])
        batches: list[list[_Sequence]] = [[]]
        for sequence in sorted(sequences, key=lambda s: len(s.tokens) - s.cached):
            width = len(sequence.tokens) - sequence.cached
            if batches[-1] and width * (len(batches[-1]) + 1) > self.prefill_tokens:
                batches.append([])
            batches[-1].append(sequence)
        for batch in batches:
            self._prefill_batch(batch, options)

    def _write(self, sequences: list[_Sequence], ends: list[int]) -> torch.Tensor:
        """One forward of tokens[cached:end] of each sequence (their keys and values into the cache; cached
        moves to end) -> (n, H) hidden states of each one's last token."""
        assert self.cache is not None
        model, device, generator = self.model, self.generator.device, self.generator
        width = max(end - s.cached for s, end in zip(sequences, ends))
        tokens = torch.full((len(sequences), width), generator.pad_id, dtype=torch.int64)
        columns = torch.full((len(sequences), width), -1, dtype=torch.int64)
        for row, (sequence, end) in enumerate(zip(sequences, ends)):
            tokens[row, : end - sequence.cached] = torch.tensor(sequence.tokens[sequence.cached : end])
            columns[row, : end - sequence.cached] = torch.arange(sequence.cached, end)
        last = torch.tensor([end - s.cached - 1 for s, end in zip(sequences, ends)], device=device)
        self.prefilled_tokens += int(last.sum()) + len(sequences)
        self.cache.bind(self._tables(sequences))
        recorder = None
        if self.record:  # by row and offset in this forward, then copied to each sequence's positions
            buffer = torch.full((len(sequences), width, *self._routing_shape()), -1, dtype=torch.int16, device=device)
            recorder = RoutingRecorder(buffer, torch.arange(width, device=device).expand(len(sequences), width))
        attach_recorder(model.moe_layers, recorder)
        with autocast(device, generator.amp_dtype):
            hidden = model.cached_hidden_states(tokens.to(device), self.cache, columns.to(device), 0)
        if recorder is not None:
            recorded = recorder.buffer.cpu()
            for row, (sequence, end) in enumerate(zip(sequences, ends)):
                assert sequence.routing is not None
                sequence.routing[sequence.cached : end] = recorded[row, : end - sequence.cached]
        for sequence, end in zip(sequences, ends):
            sequence.cached = end
        return hidden[torch.arange(len(sequences), device=device), last]

    def _prefill_batch(self, sequences: list[_Sequence], options: SamplingOptions) -> None:
        assert self.cache is not None
        generator = self.generator
        hidden = self._write(sequences, [len(s.tokens) for s in sequences])
        with autocast(generator.device, generator.amp_dtype):
            logits = self.model.head_logits(hidden, generator.head_weight if generator.cuda_graph else None).float()
        for row, sequence in enumerate(sequences):
            prompt = sequence.prompt
            if prompt is not None:
                prompt.waiting -= 1
                sequence.prompt = None
                if prompt.waiting:  # siblings will start from these blocks and logits
                    prompt.blocks = [[a.share(b) for b in blocks]
                                     for a, blocks in zip(self.cache.allocators, sequence.blocks)]
                    prompt.logits = logits[row].clone()
                    if sequence.routing is not None:  # and this routing of its tokens
                        prompt.routing = sequence.routing[: len(prompt.tokens)].clone()
        self._draw(sequences, logits, options)
        for sequence in sequences:
            self._release_window(sequence)

    def _start_siblings(self, sequences: list[_Sequence], options: SamplingOptions) -> None:
        """Siblings share their prompt's full blocks, copy its partial block, draw from its kept logits."""
        assert self.cache is not None
        cache, size = self.cache, self.block_size
        logits = []
        copies: list[tuple[list[int], list[int]]] = [([], []) for _ in cache.allocators]  # per group: sources, targets
        for sequence in sequences:
            prompt = sequence.prompt
            assert prompt is not None and prompt.blocks is not None and prompt.logits is not None
            full = len(prompt.tokens) // size
            for group, (allocator, blocks) in enumerate(zip(cache.allocators, prompt.blocks)):
                own = [allocator.share(b) for b in blocks[:full]]
                if len(blocks) > full:
                    own.append(allocator.allocate())
                    copies[group][0].append(blocks[full])
                    copies[group][1].append(own[-1])
                sequence.blocks[group] = own
            sequence.cached = len(prompt.tokens)
            if sequence.routing is not None:
                assert prompt.routing is not None
                sequence.routing[: len(prompt.tokens)] = prompt.routing
            logits.append(prompt.logits)
            prompt.waiting -= 1
            sequence.prompt = None
            if not prompt.waiting:
                self._drop_prompt(prompt)
        for group, (sources, targets) in enumerate(copies):
            if sources:
                cache.copy_blocks(group, sources, targets)
        self._note_peak()
        self._draw(sequences, torch.stack(logits), options)
        for sequence in sequences:
            self._release_window(sequence)

    def _slot_step(self, batch: int, options: SamplingOptions) -> SlotStep:
        """The decode step for `batch` live rows: eager at their count, or the captured graph of the
        smallest bucket (max_slots / 4^k) that holds them."""
        assert self.cache is not None
        generator = self.generator
        if self.graphs:
            bucket = self.max_slots
            while bucket // 4 >= max(batch, 8):
                bucket //= 4
        else:
            bucket = batch
        key = (bucket, options)
        if key in self.steps:
            return self.steps[key]
        if options not in self.states:
            widths = [math.ceil(self.generator.model.config.max_seq_len / self.block_size)] * len(self.cache.windows)
            self.states[options] = SlotState(self.max_slots, self.check_every, widths, options, generator.device,
                                             self._routing_shape() if self.record else None)
        try:
            step = self._new_step(bucket, options)
        except Exception as error:  # noqa: BLE001 - a compiler failure means "decode the plain way", as the static path
            if not (generator.compile or self.cache.decode_attention == "flex"):
                raise
            print(f"fastlm: building the engine's decode step (compile={generator.compile}, "
                  f"{self.cache.decode_attention} attention) failed ({first_line(error)}); decoding without compile, "
                  f"and without graphs (SDPA over the live rows' gathered blocks)", file=sys.stderr, flush=True)
            generator.compile, generator.decode_attention, self.cache.decode_attention = False, "sdpa", "sdpa"
            self.graphs, bucket = False, batch
            self.steps.clear()
            step = self._new_step(bucket, options)
        if self.graphs:
            self.steps[key] = step
        return step

    def _new_step(self, bucket: int, options: SamplingOptions) -> SlotStep:
        generator = self.generator
        assert self.cache is not None
        return SlotStep(self.model, self.cache, self.states[options], bucket, options, generator.vocab, generator.pad_id,
                        generator.head_weight if generator.cuda_graph else None, generator.amp_dtype,
                        self.graphs, generator.compile)

    def _decode(self, running: list[_Sequence], options: SamplingOptions) -> None:
        """`check_every` decode steps of the running sequences, then their draws read back once."""
        assert self.cache is not None
        step = self._slot_step(len(running), options)
        state = step.state
        rows = {
            "tokens": torch.tensor([s.tokens[-1] for s in running]),
            "columns": torch.tensor([len(s.tokens) - 1 for s in running]),
            "seeds": torch.tensor([s.seed for s in running]),
            "steps": torch.tensor([s.drawn for s in running]),
            "budgets": torch.tensor([s.budget for s in running]),
            "done": torch.zeros(len(running), dtype=torch.bool),
        }
        tables = self._tables(running)
        state.load(rows, tables)
        if step.graph is None:  # eager: read only the live rows' blocks (a graph reads its fixed width)
            state.widths = [table.shape[1] for table in tables]
        chunk = min(self.check_every, max(s.budget - s.drawn for s in running))
        attach_recorder(self.model.moe_layers, step.recorder)
        for _ in range(chunk):
            step()
        drawn, logprobs = state.drawn[: len(running), :chunk].tolist(), state.logprobs[: len(running), :chunk].tolist()
        routed = None if state.routing is None else state.routing[: len(running), :chunk].cpu()
        stops = set(options.stop_tokens)
        for row, (sequence, tokens, values) in enumerate(zip(running, drawn, logprobs)):
            fed = len(sequence.tokens) - 1  # step j fed the token at position fed + j
            for token, value in zip(tokens, values):
                if sequence.done:
                    break
                sequence.tokens.append(token)
                sequence.logprobs.append(value)
                sequence.stopped = token in stops
            if routed is not None and sequence.routing is not None:
                appended = len(sequence.tokens) - 1 - fed  # each token appended this chunk was one step's draw
                sequence.routing[fed : fed + appended] = routed[row, :appended]
            sequence.cached = len(sequence.tokens) - 1
            self._release_window(sequence)


class _Decoding:
    """Around a request: the replica synced (graph path) and the decoding model in eval mode."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __enter__(self) -> None:
        generator = self.engine.generator
        if generator.cuda_graph:
            generator.sync_before_decoding()
        self.model = self.engine.model
        self.was_training = self.model.training
        self.model.eval()

    def __exit__(self, *exc: object) -> None:
        attach_recorder(self.model.moe_layers, None)  # a training forward records nothing
        self.model.train(self.was_training)


class EngineSession:
    """Multi-turn episodes on the engine (the `TurnSession` protocol, as `Continuation` on the static cache):
    each row keeps its blocks between turns, and a turn prefills only the tokens appended since."""

    def __init__(self, engine: Engine, options: SamplingOptions, limit: int) -> None:
        self.engine, self.options, self.limit = engine, options, limit
        self.sequences: list[_Sequence] = []
        self.idle: list[_Sequence] = []
        self.epoch = -1

    def room(self, row: int, appended: int) -> bool:
        """Whether `row` can take `appended` more tokens and then at least one sampled token."""
        return len(self.sequences[row].tokens) + appended < self.limit

    @torch.no_grad()
    def start(self, prompts: list[list[int]], generator: torch.Generator | None = None) -> list[Completion]:
        """The first turn of every row (one completion per prompt)."""
        engine, options = self.engine, self.options
        check_prompts(prompts, options, engine.generator.model)
        too_long = [i for i, prompt in enumerate(prompts) if len(prompt) >= self.limit]
        if too_long:
            raise ValueError(f"prompt {too_long[0]} has {len(prompts[too_long[0]])} tokens, no room under the "
                             f"episode limit ({self.limit})")
        seeds = sequence_seeds(len(prompts), generator, engine.generator.device).tolist()
        shared: dict[tuple[int, ...], _Prompt] = {}
        self.sequences = []
        for index, (prompt, seed) in enumerate(zip(prompts, seeds)):
            entry = shared.setdefault(tuple(prompt), _Prompt(list(prompt), 0))
            entry.waiting += 1
            budget = min(options.max_new_tokens, self.limit - len(prompt))
            self.sequences.append(_Sequence(index, list(prompt), len(prompt), seed, budget, entry))
        with engine._decoding():
            engine._ensure_cache([_Sequence(0, list(p), len(p), 0, self.limit - len(p)) for p in prompts])
            self.epoch, self.idle = engine.epoch, []
            engine._run(self.sequences, options, keep=True, idle=self.idle)
        return [s.completion() for s in self.sequences]

    @torch.no_grad()
    def extend(self, appended: dict[int, list[int]], generator: torch.Generator | None = None) -> dict[int, Completion]:
        """Append tokens to the rows that go on and sample their next turn; every other row is finished."""
        engine = self.engine
        if self.epoch != engine.epoch:
            raise RuntimeError("extend before start, or after another request reused the engine's cache")
        for row, tokens in appended.items():
            if not tokens or not self.room(row, len(tokens)):
                raise ValueError(f"row {row}: {len(tokens)} appended tokens do not fit (check `room` first)")
        seeds = sequence_seeds(len(self.sequences), generator, engine.generator.device).tolist()
        going = []
        for row, sequence in enumerate(self.sequences):
            if row not in appended:
                if sequence in self.idle:
                    self.idle.remove(sequence)
                engine._release(sequence)
                continue
            sequence.tokens.extend(appended[row])
            sequence.turn_start, sequence.seed = len(sequence.tokens), seeds[row]
            sequence.budget = min(self.options.max_new_tokens, self.limit - len(sequence.tokens))
            sequence.logprobs, sequence.stopped = [], False
            if sequence in self.idle:
                self.idle.remove(sequence)
            going.append(sequence)
        with engine._decoding():
            engine._run(going, self.options, keep=True, idle=self.idle)
        return {s.index: s.completion() for s in going}
