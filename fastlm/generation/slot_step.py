"""The engine's decode step over its slot batch: device buffers for `max_slots` rows, a step that feeds each
live row's last token, writes its key and value through the block table and draws the next token, run
eagerly or captured in a CUDA graph per slot-count bucket (rows past the live count are dead: zero block
tables send their writes to the scratch block, and they are marked done).

Per row: `tokens` (the input), `columns` (its cache column), `seeds` and `steps` (the sequence's seed and
draw index: sampling.py), `budgets` (draws allowed this turn), `done`; per chunk of steps, `drawn` and
`logprobs` (rows x chunk) and the chunk `index`; with routing replay, `routing` (rows x chunk x layers x k).
The host refills them between chunks (engine.py).
"""

from __future__ import annotations

import torch

from fastlm.generation.cuda_graph import capture
from fastlm.generation.paged_cache import PagedKVCache
from fastlm.generation.sampling import SamplingOptions, draw_uniforms, pick_tokens
from fastlm.layers.moe import RoutingRecorder, attach_recorder
from fastlm.models.decoder import DecoderLM
from fastlm.system.device import autocast


class SlotState:
    """The device buffers of the slot batch (static addresses: CUDA graphs read them)."""

    def __init__(self, slots: int, chunk: int, widths: list[int], options: SamplingOptions,
                 device: torch.device, routing: tuple[int, int] | None = None) -> None:
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.tokens, self.columns, self.seeds, self.steps, self.budgets = (zeros(slots) for _ in range(5))
        self.done = zeros(slots, dtype=torch.bool)
        self.tables = [zeros(slots, width) for width in widths]  # per window group
        self.widths = list(widths)  # table columns a forward reads (eager: the live rows' longest; graphs: all)
        self.drawn, self.logprobs = zeros(slots, chunk), zeros(slots, chunk, dtype=torch.float32)
        self.index = zeros()
        self.stops = torch.tensor(options.stop_tokens, dtype=torch.int64, device=device)
        # routing replay: (M MoE layers, k) given, each step's fed token's experts (rows x chunk x M x k)
        self.routing = None if routing is None else zeros(slots, chunk, *routing, dtype=torch.int16)

    @property
    def buffers(self) -> list[torch.Tensor]:
        return [self.tokens, self.columns, self.seeds, self.steps, self.budgets, self.done, *self.tables, self.drawn,
                self.logprobs, self.index, *([] if self.routing is None else [self.routing])]

    def load(self, rows: dict[str, torch.Tensor], tables: list[torch.Tensor]) -> None:
        """Copy the host's rows (the first n slots); later slots become dead rows."""
        count = len(rows["tokens"])
        for name, values in rows.items():
            buffer = getattr(self, name)
            buffer[:count].copy_(values, non_blocking=True)
            buffer[count:].zero_()
        self.done[count:] = True
        for buffer, table in zip(self.tables, tables):
            buffer.zero_()
            buffer[:count, : table.shape[1]].copy_(table, non_blocking=True)
        self.index.zero_()


class SlotStep:
    """One decode step on the first `batch` slots (see the module docstring); `cuda_graph` captures it."""

    def __init__(self, model: DecoderLM, cache: PagedKVCache, state: SlotState, batch: int, options: SamplingOptions,
                 vocab: int, pad_id: int, head_weight: torch.Tensor | None, amp_dtype: torch.dtype | None,
                 cuda_graph: bool, compile: bool) -> None:
        self.model, self.cache, self.state, self.batch, self.options = model, cache, state, batch, options
        self.vocab, self.pad_id, self.head_weight, self.amp_dtype = vocab, pad_id, head_weight, amp_dtype
        # routing replay: the MoE layers write the fed tokens' experts at the step's slot of the chunk
        self.recorder = None if state.routing is None else RoutingRecorder(state.routing[:batch],
                                                                          state.index.expand(batch, 1))
        attach_recorder(model.moe_layers, self.recorder)  # before a compile or capture: the graph holds the writes
        self.run = self.forward
        if compile:
            for buffer in cache.buffers + state.buffers:
                torch._dynamo.mark_static_address(buffer)
            self.run = torch.compile(self.forward, fullgraph=True, dynamic=False)
        self.graph: torch.cuda.CUDAGraph | None = None
        if cuda_graph:
            self.graph = capture(self.run, self._rewind)

    def forward(self) -> None:
        state, rows = self.state, slice(0, self.batch)
        device = state.tokens.device
        context = autocast(device, self.amp_dtype) if self.amp_dtype is None else torch.autocast(
            device.type, dtype=self.amp_dtype, cache_enabled=False)
        columns = state.columns[rows, None]
        self.cache.bind([table[rows, :width] for table, width in zip(state.tables, state.widths)])
        with context:
            hidden = self.model.cached_hidden_states(state.tokens[rows, None], self.cache, columns, 0)
            logits = self.model.head_logits(hidden[:, -1], self.head_weight)
        done, steps = state.done[rows], state.steps[rows]
        uniforms = None if self.options.greedy else draw_uniforms(state.seeds[rows], steps)
        choice, logprob = pick_tokens(logits[:, : self.vocab], self.options, uniforms)
        slot = state.index[None]
        state.drawn[rows].index_copy_(1, slot, choice.masked_fill(done, self.pad_id)[:, None])
        state.logprobs[rows].index_copy_(1, slot, logprob.masked_fill(done, 0.0)[:, None])
        stopped = steps + 1 >= state.budgets[rows]
        if state.stops.numel():
            stopped |= (choice[:, None] == state.stops).any(dim=-1)
        done |= stopped
        state.tokens[rows] = choice
        state.columns[rows] += 1
        steps += 1
        state.index += 1

    def _rewind(self) -> None:
        state = self.state
        for buffer in (state.columns, state.index, state.steps, *state.tables):
            buffer.zero_()
        state.budgets.fill_(1)
        state.done.fill_(True)

    def __call__(self) -> None:
        if self.graph is None:
            self.run()
        else:
            self.graph.replay()
