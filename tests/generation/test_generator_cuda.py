"""The generator's CUDA paths: the FlexAttention decode kernel against a float64 reference, and the
CUDA-graph decode step (FlexAttention or SDPA, eager or compiled) against the eager SDPA path."""

from __future__ import annotations

import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (CUDA graphs, the FlexAttention decode kernel)", allow_module_level=True)

from fastlm.data.tokenizer import ByteTokenizer
from fastlm.generation import Generator, SamplingOptions
from fastlm.layers.kv_cache import KVCache
from tests.models.model_helpers import load_preset, make_model, relative_error

TOKENIZER = ByteTokenizer()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles FlexAttention (and a decode step) for its own shapes: start from an empty dynamo
    cache so the recompile limit never silently sends a later test to the unfused fallback."""
    torch._dynamo.reset()
    yield


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "kv_heads", "window", "uniform"), [
    (torch.bfloat16, 2, 100, True),  # grouped heads, window, left padding
    (torch.float32, 8, None, False),  # no grouping, right padding (a row per column)
])
def test_flex_decode_matches_float64(dtype: torch.dtype, kv_heads: int, window: int | None, uniform: bool) -> None:
    """One decode step's attention (write k, v at the row's column, attend over the whole cache through the
    block mask) against softmax(q K^T / sqrt(d) + mask) V in float64, left (uniform) and right padding."""
    batch, heads, length, dim = 5, 8, 320, 64
    rng = torch.Generator().manual_seed(kv_heads * 10 + (window or 0))
    cache = KVCache(1, batch, heads, kv_heads, length, dim, dtype, "cuda", uniform_columns=uniform,
                    decode_attention="flex")
    for buffer in cache.buffers:
        buffer.copy_(torch.randn(buffer.shape, generator=rng))
    own = torch.full((batch,), 250) if uniform else torch.randint(1, length, (batch,), generator=rng)
    start = (own * torch.rand(batch, generator=rng)).long() if uniform else torch.zeros(batch, dtype=torch.int64)
    cache.start.copy_(start)
    columns = own[:, None].cuda()
    q, k, v = (torch.randn(batch, h, 1, dim, generator=rng).to(dtype) for h in (heads, kv_heads, kv_heads))
    mask = cache.attention_mask(columns, length, window)
    assert mask.blocks is not None
    out = cache.layer(0, columns, length, mask).attend(q.cuda(), k.cuda(), v.cuda())
    keys, values = cache.keys[0].double().cpu(), cache.values[0].double().cpu()  # the new k, v written
    visible = cache.mask(columns, length, window)[:, 0, :1].cpu() == 0  # (B, 1, length)
    scores = q.double() @ keys.repeat_interleave(heads // kv_heads, 1).transpose(-1, -2) / math.sqrt(dim)
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    want = torch.softmax(scores, dim=-1) @ values.repeat_interleave(heads // kv_heads, 1)
    error = relative_error(out.double().cpu(), want)
    print(f"flex decode {dtype}, kv_heads {kv_heads}, window {window}, uniform {uniform}: rel err {error:.2e}")
    assert error < (1e-5 if dtype == torch.float32 else 1e-2)


def _model(name: str, dtype: torch.dtype = torch.float32):
    config = load_preset(name).model_copy(update={"num_layers": 2})
    return make_model(config, dtype=dtype, seed=3).cuda()


def _prompts(count: int = 6) -> list[list[int]]:
    rng = torch.Generator().manual_seed(4)
    lengths = [1, 17, 70, 100, 33, 64][:count]  # several 64-column key blocks, uneven left padding
    return [torch.randint(3, 256, (n,), generator=rng).tolist() for n in lengths]


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "attention", "compile"), [
    ("tiny-llama", "flex", False), ("tiny-llama", "sdpa", False), ("mistral-tiny", "flex", False),
    ("tiny-llama", "flex", True), ("gemma3-tiny", "flex", False), ("gemma3-tiny", "flex", True),
    ("gemma2-tiny", "flex", False), ("gemma2-tiny", "flex", True), ("gpt-oss-tiny", "flex", False),  # softcap, sinks
])
def test_graph_step_matches_eager(name: str, attention: str, compile: bool) -> None:
    """float32 replica in a CUDA graph (optionally compiled) vs the live model eagerly with SDPA: the same
    greedy tokens, the same seeded samples (each row's draws hash its sequence seed and draw index),
    log-probs within float32 rounding; graph replays are reproducible; without compile also: stop tokens
    end the rows, a weight update reaches the graph (each option set compiles anew; the compiled case keeps
    to the sampled one)."""
    model = _model(name)
    prompts = _prompts()
    eager = Generator(model, TOKENIZER, cuda_graph=False)
    graph = Generator(model, TOKENIZER, cuda_graph=True, compile=compile, decode_attention=attention)
    cases = [(SamplingOptions(60, temperature=0.0), None), (SamplingOptions(60, temperature=1.0), 5)]
    for options, seed in cases[1:] if compile else cases:  # compiled: one compile, the sampled case (the draw in the graph)
        def run(engine: Generator, options: SamplingOptions = options, seed: int | None = seed):
            generator = None if seed is None else torch.Generator("cuda").manual_seed(seed)
            return engine.generate(prompts, options, generator)

        want, got, again = run(eager), run(graph), run(graph)  # `again` replays the captured graph
        assert [c.tokens for c in got] == [c.tokens for c in want]
        assert [c.tokens for c in again] == [c.tokens for c in got]
        error = relative_error(torch.tensor([c.logprobs for c in got]), torch.tensor([c.logprobs for c in want]))
        print(f"{name} graph ({attention}, compile={compile}) vs eager, T={options.temperature}: tokens equal, "
              f"log-prob rel err {error:.2e}")
        assert error < 1e-4
    assert (graph.compile, graph.decode_attention) == (compile, attention), "the step fell back (see stderr)"
    if compile:
        return  # the rest is the same step under other options: a recompile each, the eager graph covers it
    greedy = graph.generate(prompts, SamplingOptions(60, temperature=0.0))
    stops = tuple({c.tokens[3] for c in greedy})  # every row stops by its 4th token
    stopped = graph.generate(prompts, SamplingOptions(60, temperature=0.0, stop_tokens=stops))
    for row, full in zip(stopped, greedy):
        end = next(i + 1 for i, token in enumerate(full.tokens) if token in stops)
        assert row.stopped and row.tokens == full.tokens[:end] and end <= 4
    with torch.no_grad():
        model.embeddings.tokens.weight.mul_(1.5)
    options = SamplingOptions(20, temperature=0.0)
    assert [c.tokens for c in graph.generate(prompts, options)] == [c.tokens for c in eager.generate(prompts, options)]
