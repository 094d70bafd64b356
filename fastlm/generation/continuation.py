"""Multi-turn decoding on one KV cache: a turn's sampled tokens stay cached, and the next turn starts from a
prefill of only the tokens appended after them (an environment's reply), never from the whole prefix again.

`Continuation` holds one batch of rows for a `Generator` built with `padding="right"` (each row writes its
own cache columns, `kv_cache.py`). `start` prefills the prompts and samples the first turn exactly as
`Generator.generate` does. `extend` takes the rows that go on and the tokens to append to each: one prefill
forward writes the turn's last sampled token (its stop token, or the last one of the budget: a decode step
feeds a drawn token back only on the next step, so the turn's last one is not cached yet) and the appended
tokens at the row's next columns; the first token of the next turn is drawn from the last appended token's logits, and decoding
continues as usual. Rows finish independently: a row left out of `extend` is done for good; it is marked
done (it draws padding) and its decode steps write into a parking area past every live column. The host
tracks each row's length, so a row's next columns follow its real tokens whatever the others did.

Cache layout, with `limit` the most tokens a row may hold and M = max_new_tokens: columns [0, limit) hold
a row's kept tokens. A turn may start while the row has room for one more token (the caller checks
`room`) and is cut at `limit` (a cut turn has not stopped); its decode writes past `limit` (at most M - 1
columns) are never read. Finished rows park their decode writes at [limit, limit + M) (each row owns its
columns, so that is only a bound), and column limit + M takes the padding of ragged prefills. Positions are
columns, so limit + M + 1 <= model.max_seq_len keeps learned position tables in range.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from fastlm.generation.generator import (
    Completion,
    Generator,
    _completions,
    _DecodeStep,
    check_prompts,
)
from fastlm.generation.sampling import SamplingOptions, sequence_seeds
from fastlm.models.decoder import DecoderLM
from fastlm.system.device import autocast


class Continuation:
    """One batch of rows decoded turn by turn (see the module docstring)."""

    def __init__(self, engine: Generator, options: SamplingOptions, limit: int) -> None:
        if engine.padding != "right":
            raise ValueError("a Continuation needs a Generator with padding='right' (each row at its own columns)")
        if engine.model.rope_switch_positions:
            raise ValueError("multi-turn sessions do not recompute the cache where longrope switches to its long "
                             "factors (parked rows count as long): use single-turn generation for this model")
        room = engine.model.config.max_seq_len - options.max_new_tokens - 1
        if limit > room:
            raise ValueError(f"limit {limit} leaves no parking columns: it must be <= model.max_seq_len - "
                             f"max_new_tokens - 1 = {room}")
        self.engine, self.options, self.limit = engine, options, limit
        self.lengths: list[int] = []  # tokens of each row so far, the last sampled one included
        self.last: list[int] = []  # each row's last sampled token, not yet in the cache
        self.step: _DecodeStep | None = None

    def room(self, row: int, appended: int) -> bool:
        """Whether `row` can take `appended` more tokens and then at least one sampled token."""
        return self.lengths[row] + appended < self.limit

    def _fit(self, completion: Completion, start: int) -> Completion:
        """A turn that starts after `start` tokens, cut at `limit` (then it has not stopped)."""
        keep = self.limit - start
        if len(completion.tokens) <= keep:
            return completion
        return Completion(completion.tokens[:keep], completion.logprobs[:keep], False)

    @contextmanager
    def _model(self) -> Iterator[tuple[DecoderLM, torch.Tensor | None]]:
        """The model that decodes (the replica on the graph path, weights synced at `start`), in eval mode."""
        engine = self.engine
        model, head_weight = (engine.replica, engine.head_weight) if engine.cuda_graph else (engine.model, None)
        assert model is not None
        was_training = model.training
        model.eval()
        try:
            yield model, head_weight
        finally:
            model.train(was_training)

    @torch.no_grad()
    def start(self, prompts: list[list[int]], generator: torch.Generator | None = None) -> list[Completion]:
        """The first turn of every row (one completion per prompt)."""
        engine, options = self.engine, self.options
        check_prompts(prompts, options, engine.model)
        too_long = [i for i, prompt in enumerate(prompts) if len(prompt) >= self.limit]
        if too_long:
            raise ValueError(f"prompt {too_long[0]} has {len(prompts[too_long[0]])} tokens, no room under the "
                             f"episode limit ({self.limit})")
        if engine.cuda_graph:
            engine.sync_before_decoding()
        length = self.limit + options.max_new_tokens + 1
        with self._model() as (model, head_weight):
            self.step = engine._decode_step(model, head_weight, len(prompts), length, options)
            width = max(len(p) for p in prompts)
            completions = engine._generate(model, head_weight, self.step, prompts, generator, width)
        completions = [self._fit(c, len(p)) for p, c in zip(prompts, completions)]
        self.lengths = [len(p) + len(c.tokens) for p, c in zip(prompts, completions)]
        self.last = [c.tokens[-1] for c in completions]
        return completions

    @torch.no_grad()
    def extend(self, appended: dict[int, list[int]], generator: torch.Generator | None = None) -> dict[int, Completion]:
        """Append tokens to the rows that go on and sample their next turn; every other row is finished."""
        step = self.step
        if step is None:
            raise RuntimeError("extend before start")
        for row, tokens in appended.items():
            if not tokens or not self.room(row, len(tokens)):
                raise ValueError(f"row {row}: {len(tokens)} appended tokens do not fit (check `room` first)")
        engine, cache, state, options = self.engine, step.cache, step.state, self.options
        device, batch, pad = engine.device, cache.batch, engine.pad_id
        width = max(len(tokens) for tokens in appended.values()) + 1
        park, spill = self.limit, self.limit + options.max_new_tokens
        tokens = torch.full((batch, width), pad, dtype=torch.int64)
        columns = torch.full((batch, width), spill, dtype=torch.int64)
        last = torch.zeros(batch, dtype=torch.int64)
        following = torch.full((batch,), park, dtype=torch.int64)
        for row, new in appended.items():
            start = self.lengths[row] - 1
            tokens[row, : len(new) + 1] = torch.tensor([self.last[row], *new])
            columns[row, : len(new) + 1] = torch.arange(start, start + len(new) + 1)
            last[row], following[row] = len(new), start + len(new) + 1
        finished = torch.ones(batch, dtype=torch.bool)
        finished[list(appended)] = False
        with self._model() as (model, head_weight):
            state.reset(following[:, None].to(device), pad, sequence_seeds(batch, generator, device))
            state.done.copy_(finished.to(device))  # finished rows: their recurrent states stay as they are
            cache.ends.copy_(following.to(device))  # a ragged turn's padding is not part of a recurrent state
            with autocast(device, engine.amp_dtype):
                hidden = model.cached_hidden_states(tokens.to(device), cache, columns.to(device), self.limit)
                logits = model.head_logits(hidden[torch.arange(batch, device=device), last.to(device)], head_weight)
            cache.ends.fill_(cache.length)
            state.record(logits, options, pad)
            for index in range(1, options.max_new_tokens):
                if len(options.stop_tokens) and index % engine.check_every == 0 and bool(state.done.all()):
                    break
                step()
        drawn = _completions(state.drawn.cpu(), state.logprobs.cpu(), set(options.stop_tokens))
        completions = {row: self._fit(drawn[row], self.lengths[row] + len(new)) for row, new in appended.items()}
        for row, new in appended.items():
            self.lengths[row] += len(new) + len(completions[row].tokens)
            self.last[row] = completions[row].tokens[-1]
        return completions
