"""The continuous-batching engine against the static generator (fp32, CPU, fixed seeds): the same tokens and
log-probs within 1e-5 across slot refills (fewer slots than sequences), stop tokens, shared prompt prefixes,
multi-turn appends, sliding-window layers and a cache too small to hold everything at once (sequences wait
and are recomputed, never dropped); the paged FlexAttention decode mask against the gather path."""

from __future__ import annotations

import pytest
import torch

from fastlm.data.tokenizer import EOS, ByteTokenizer
from fastlm.generation import Generator, NativeBackend, SamplingOptions
from fastlm.generation.continuation import Continuation
from fastlm.generation.engine import Engine
from fastlm.generation.paged_cache import PagedKVCache
from tests.models.model_helpers import load_preset, make_model

TOKENIZER = ByteTokenizer()
STOPS = (EOS, 101, 102, 103, 104)  # frequent enough in a random tiny model that rows stop at different lengths
# Llama (RoPE, GQA), Mistral (every layer windowed), GPT-2 (learned positions), Gemma 3 (a windowed and a global
# layer: two window groups, two block tables per sequence); windows shrunk so sequences cross them.
FAMILIES = {"tiny-llama": {}, "mistral-tiny": {"sliding_window": 6}, "tiny-gpt2": {}, "gemma3-tiny": {"sliding_window": 7}}


def _model(name: str):
    config = load_preset(name).model_copy(update={"num_layers": 2, "max_seq_len": 96, **FAMILIES[name]})
    return make_model(config, dtype=torch.float32, seed=len(name))


def _grouped_prompts(group: int = 3) -> list[list[int]]:
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=rng).tolist() for n in (5, 9, 3, 12, 8)]
    return [p for p in prompts for _ in range(group)]


def _assert_same(static, engine) -> None:
    errors = []
    for index, (a, b) in enumerate(zip(static, engine, strict=True)):
        assert a.tokens == b.tokens and a.stopped == b.stopped, f"sequence {index}: {a.tokens} vs {b.tokens}"
        errors += [abs(x - y) for x, y in zip(a.logprobs, b.logprobs)]
    print(f"{len(static)} sequences, {len(errors)} tokens, max |logprob diff| {max(errors):.2e}, "
          f"lengths {[len(c.tokens) for c in static]}")
    assert max(errors) < 1e-5


@pytest.mark.parametrize("name", list(FAMILIES))
def test_engine_draws_the_static_generators_tokens(name: str) -> None:
    """15 sequences (5 prompts x 3 samples) through 4 slots with stop tokens: refills, shared prefixes."""
    model = _model(name)
    prompts, options = _grouped_prompts(), SamplingOptions(24, temperature=1.0, stop_tokens=STOPS)
    static = Generator(model, TOKENIZER).generate(prompts, options, torch.Generator().manual_seed(5))
    engine = Engine(Generator(model, TOKENIZER), max_slots=4, block_size=4, check_every=3)
    _assert_same(static, engine.generate(prompts, options, torch.Generator().manual_seed(5)))
    assert engine.prefilled_tokens == sum(len(p) for p in prompts[::3]), "each prompt is prefilled once"
    windowed = [peak for peak, window in zip(engine.peak_blocks, engine.cache.windows) if window is not None]
    whole = [peak for peak, window in zip(engine.peak_blocks, engine.cache.windows) if window is None]
    if windowed and whole:  # sliding-window layers released the blocks that left their window
        assert max(windowed) < min(whole), engine.peak_blocks
    assert len({len(c.tokens) for c in static}) > 2 and any(c.stopped for c in static)


def test_greedy_and_top_p_match_static() -> None:
    model = _model("tiny-llama")
    prompts = _grouped_prompts(2)
    for options in (SamplingOptions(12, temperature=0.0), SamplingOptions(12, 0.8, top_p=0.9, top_k=20, stop_tokens=STOPS)):
        static = Generator(model, TOKENIZER).generate(prompts, options, torch.Generator().manual_seed(1))
        engine = Engine(Generator(model, TOKENIZER), max_slots=3, block_size=4)
        _assert_same(static, engine.generate(prompts, options, torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("name", ["tiny-llama", "gemma3-tiny"])
def test_a_full_cache_makes_sequences_wait_not_fail(name: str) -> None:
    """12 blocks of 4 tokens for 15 sequences of up to 36 tokens: admission waits, running sequences are
    preempted and recomputed (prefilled in chunks), and every completion is the static path's."""
    model = _model(name)
    prompts, options = _grouped_prompts(), SamplingOptions(24, temperature=1.0, stop_tokens=STOPS)
    static = Generator(model, TOKENIZER).generate(prompts, options, torch.Generator().manual_seed(2))
    engine = Engine(Generator(model, TOKENIZER), max_slots=8, block_size=4, num_blocks=12, check_every=4,
                    prefill_tokens=6)  # recomputed sequences are prefilled in chunks of 6 tokens
    _assert_same(static, engine.generate(prompts, options, torch.Generator().manual_seed(2)))
    assert engine.admissions > len(prompts), "some sequence was preempted and started again"
    assert max(engine.peak_blocks) <= 11
    with pytest.raises(ValueError, match="kv_cache_memory_gib"):
        Engine(Generator(model, TOKENIZER), block_size=4, num_blocks=5).generate(prompts, options)


def test_memory_follows_the_tokens_held() -> None:
    """G = 8 samples of one 32-token prompt: the peak is the prompt once plus the completions (block rounding)."""
    model = _model("tiny-llama")
    prompt = torch.randint(3, 256, (32,), generator=torch.Generator().manual_seed(4)).tolist()
    options = SamplingOptions(40, temperature=1.0, stop_tokens=STOPS)
    engine = Engine(Generator(model, TOKENIZER), max_slots=8, block_size=4)
    completions = engine.generate([prompt] * 8, options, torch.Generator().manual_seed(3))
    held = 32 + sum(len(c.tokens) for c in completions)
    print(f"peak {engine.peak_blocks[0] * 4} token slots for {held} tokens held")
    assert engine.peak_blocks[0] * 4 <= held + 8 * 4


@pytest.mark.parametrize("name", ["mistral-tiny", "gemma3-tiny"])
def test_sessions_match_the_static_continuation(name: str) -> None:
    """Three turns: rows that go on get appended tokens on their own blocks, the others finish."""
    model = _model(name)
    prompts, options = _grouped_prompts(2), SamplingOptions(10, temperature=1.0, stop_tokens=STOPS)
    static = Continuation(Generator(model, TOKENIZER, padding="right"), options, 48)
    engine = Engine(Generator(model, TOKENIZER), max_slots=4, block_size=4, check_every=3).session(options, 48)
    seeds = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    _assert_same(static.start(prompts, seeds[0]), engine.start(prompts, seeds[1]))
    going = list(range(len(prompts)))
    for turn in range(2):
        going = going[turn::2]  # a row left out of a turn is finished for good
        appended = {row: [65 + row, 66 + turn] for row in going if static.room(row, 2)}
        assert appended and all(engine.room(row, 2) for row in appended)
        want, got = static.extend(appended, seeds[0]), engine.extend(appended, seeds[1])
        assert list(want) == list(got)
        _assert_same(list(want.values()), list(got.values()))


def test_backend_picks_the_engine_and_falls_back_for_families_it_cannot_serve() -> None:
    model = _model("tiny-llama")
    engine, static = NativeBackend(model, TOKENIZER, engine=True), NativeBackend(model, TOKENIZER)
    assert engine.engine is not None and static.engine is None
    prompts, options = _grouped_prompts(8)[:16], SamplingOptions(6, temperature=1.0, stop_tokens=STOPS)
    _assert_same(static.generate(prompts, options, torch.Generator().manual_seed(4)),
                 engine.generate(prompts, options, torch.Generator().manual_seed(4)))
    model.blocks[0].attn.softcap = 50.0  # Gemma 2's score softcap (and GPT-OSS's sinks): the static generator's
    assert NativeBackend(model, TOKENIZER, engine=True).engine is None
    model.blocks[0].attn = torch.nn.Identity()  # a layer that is not cached attention (e.g. a recurrent state)
    backend = NativeBackend(model, TOKENIZER, padding="right", engine=True)
    assert backend.engine is None and isinstance(backend.session(SamplingOptions(2), 8).inner, Continuation)


@pytest.mark.parametrize("window", [None, 5])
def test_paged_flex_decode_equals_the_gather_path(window: int | None) -> None:
    """One decode token per row over scattered physical blocks (shared ones included): FlexAttention through
    the block table gives the gather + SDPA result (float64)."""
    generator = torch.Generator().manual_seed(0)
    size, blocks, heads, kv_heads, dim = 4, 16, 4, 2, 8
    caches = [PagedKVCache([0], [window], heads, kv_heads, dim, size, blocks, torch.float64, "cpu", decode_attention=kind)
              for kind in ("sdpa", "flex")]
    pool = torch.randn(2, 1, kv_heads, blocks * size, dim, generator=generator, dtype=torch.float64)
    table = torch.tensor([[3, 7, 2, 0], [3, 9, 0, 0], [5, 0, 0, 0]])  # rows 0 and 1 share block 3
    columns = torch.tensor([[10], [6], [2]])
    q, k, v = (torch.randn(3, h, 1, dim, generator=generator, dtype=torch.float64) for h in (heads, kv_heads, kv_heads))
    outputs = []
    for cache in caches:
        cache.keys[0].copy_(pool[0])
        cache.values[0].copy_(pool[1])
        cache.bind([table])
        mask = cache.attention_mask(columns, 0, window)
        outputs.append(cache.layer(0, columns, 0, mask).attend(q, k, v))
    error = ((outputs[0] - outputs[1]).abs().max() / outputs[0].abs().max()).item()
    print(f"window {window}: flex vs gather rel err {error:.2e}")
    assert error < 1e-12


def test_per_sequence_budgets_force_lengths_on_both_paths() -> None:
    """The benchmark's forced lengths: each sequence draws exactly its budget (no stop tokens) on both paths."""
    model = _model("tiny-llama")
    prompts, options = _grouped_prompts(2), SamplingOptions(20, temperature=1.0)
    budgets = [1 + (7 * i) % 20 for i in range(len(prompts))]
    static = Generator(model, TOKENIZER).generate(prompts, options, torch.Generator().manual_seed(9), budgets)
    engine = Engine(Generator(model, TOKENIZER), max_slots=3, block_size=4)
    _assert_same(static, engine.generate(prompts, options, torch.Generator().manual_seed(9), budgets))
    assert [len(c.tokens) for c in static] == budgets
    with pytest.raises(ValueError, match="budgets"):
        engine.generate(prompts, options, budgets=[21] * len(prompts))


def test_a_failing_flex_step_falls_back_to_sdpa_without_graphs(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """A compiler error while building the engine's step is said in one line; decoding continues eagerly with
    SDPA over the gathered blocks and gives the same tokens."""
    import fastlm.generation.engine as engine_module

    class FailingFlexStep(engine_module.SlotStep):
        def __init__(self, model, cache, *args) -> None:
            if cache.decode_attention == "flex":
                raise RuntimeError("inductor could not lower flex_decoding\nsecond line")
            super().__init__(model, cache, *args)

    monkeypatch.setattr(engine_module, "SlotStep", FailingFlexStep)
    model = _model("tiny-llama")
    prompts, options = _grouped_prompts(2), SamplingOptions(8, temperature=1.0, stop_tokens=STOPS)
    engine = Engine(Generator(model, TOKENIZER, decode_attention="flex"), max_slots=4, block_size=4)
    got = engine.generate(prompts, options, torch.Generator().manual_seed(3))
    assert "failed (RuntimeError: inductor could not lower flex_decoding); decoding without compile" in capsys.readouterr().err
    assert engine.cache is not None and engine.cache.decode_attention == "sdpa" and not engine.graphs
    _assert_same(Generator(model, TOKENIZER).generate(prompts, options, torch.Generator().manual_seed(3)), got)


def test_the_slot_step_traces_whole() -> None:
    """`compile=True` (rl.backend.compile_decode) needs the step in one graph: dynamo traces it with fullgraph
    (paged flex decode, a windowed layer) and the traced step draws what the eager one draws."""
    model = _model("mistral-tiny")
    options = SamplingOptions(12, temperature=1.0, stop_tokens=STOPS)
    engine = Engine(Generator(model, TOKENIZER), max_slots=4, block_size=4, check_every=2)
    engine.generate(_grouped_prompts(1)[:4], options, torch.Generator().manual_seed(1))  # builds the cache
    assert engine.cache is not None
    engine.cache.decode_attention = "flex"
    step = engine._slot_step(3, options)
    rows = {"tokens": torch.tensor([5, 6, 7]), "columns": torch.tensor([9, 4, 13]), "seeds": torch.tensor([1, 2, 3]),
            "steps": torch.zeros(3, dtype=torch.int64), "budgets": torch.full((3,), 9),
            "done": torch.zeros(3, dtype=torch.bool)}
    tables = [torch.tensor([[1, 2, 3, 4], [5, 6, 0, 0], [7, 8, 9, 10]])]
    drawn = []
    for run in (step.forward, torch.compile(step.forward, fullgraph=True, dynamic=False, backend="eager")):
        step.state.load(rows, tables)
        with torch.no_grad():
            run()
            run()
        drawn.append((step.state.drawn[:3].clone(), step.state.logprobs[:3].clone()))
    assert torch.equal(drawn[0][0], drawn[1][0]) and torch.allclose(drawn[0][1], drawn[1][1])
