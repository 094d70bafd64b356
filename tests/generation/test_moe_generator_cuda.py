"""MoE models on the generator's CUDA-graph path: the routing has fixed shapes and device offsets, so the
decode step captures (a host read would fail the capture) and replays. float32 captures the gather path
(grouped GEMMs take bf16 only) against the eager loop; under bf16 autocast both take the grouped GEMMs
(the replica's weights stored in bf16, the live model's cast by autocast)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (CUDA graphs, grouped GEMMs)", allow_module_level=True)

from fastlm.data.tokenizer import ByteTokenizer
from fastlm.generation import Generator, SamplingOptions
from tests.models.model_helpers import load_preset, make_model

TOKENIZER = ByteTokenizer()


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "amp", "compile"), [
    ("mixtral-tiny", None, False), ("qwen3-moe-tiny", None, False), ("qwen3-moe-tiny", torch.bfloat16, False),
    ("mixtral-tiny", None, True), ("deepseek-v3-tiny", None, False), ("deepseek-v3-tiny", None, True),
    ("deepseek-v3-tiny", torch.bfloat16, False),  # the latent cache under FlexAttention decode in the graph
])
def test_moe_graph_step_matches_eager(name: str, amp: torch.dtype | None, compile: bool) -> None:
    torch._dynamo.reset()
    model = make_model(load_preset(name), dtype=torch.float32, seed=3).cuda()
    rng = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=rng).tolist() for n in (1, 17, 70, 33)]
    options = SamplingOptions(40, temperature=0.0)
    eager = Generator(model, TOKENIZER, amp_dtype=amp, cuda_graph=False)
    graph = Generator(model, TOKENIZER, amp_dtype=amp, cuda_graph=True, compile=compile)
    want = [c.tokens for c in eager.generate(prompts, options)]
    got = [c.tokens for c in graph.generate(prompts, options)]
    again = [c.tokens for c in graph.generate(prompts, options)]  # replays the captured graph
    agree = sum(a == b for a, b in zip(got, want))
    print(f"{name} amp={amp} compile={compile}: {agree}/{len(want)} rows equal to eager")
    assert again == got
    if amp is None:
        assert got == want
    else:  # bf16: stored vs autocast-cast weights may round a near-tie apart late in a row
        assert all(a[:4] == b[:4] for a, b in zip(got, want))


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "compile"), [("qwen3-moe-tiny", False), ("qwen3-moe-tiny", True),
                                               ("deepseek-v3-tiny", False)])
def test_graph_step_records_the_routing_of_eager_decoding(name: str, compile: bool) -> None:
    """Routing replay on the graph path: the captured decode step writes each token's experts (by cache column)
    as eager decoding does, replay after replay."""
    torch._dynamo.reset()
    model = make_model(load_preset(name), dtype=torch.float32, seed=3).cuda()
    rng = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=rng).tolist() for n in (1, 17, 70, 33)]
    options = SamplingOptions(24, temperature=0.0)
    eager = Generator(model, TOKENIZER, cuda_graph=False, record_routing=True).generate(prompts, options)
    graph = Generator(model, TOKENIZER, cuda_graph=True, compile=compile, record_routing=True)
    for _ in range(2):
        got = graph.generate(prompts, options)
        assert [c.tokens for c in got] == [c.tokens for c in eager]
        for ours, want in zip(got, eager):
            assert ours.routing is not None and want.routing is not None
            assert torch.equal(ours.routing, want.routing)


@pytest.mark.gpu
def test_engine_graph_step_records_the_routing_of_eager_decoding() -> None:
    """Routing replay on the engine's captured slot steps: the same experts as the eager static generator."""
    from fastlm.generation.engine import Engine

    torch._dynamo.reset()
    model = make_model(load_preset("qwen3-moe-tiny"), dtype=torch.float32, seed=3).cuda()
    rng = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=rng).tolist() for n in (1, 17, 17, 70, 33)]
    options = SamplingOptions(24, temperature=0.0)
    eager = Generator(model, TOKENIZER, cuda_graph=False, record_routing=True).generate(prompts, options)
    engine = Engine(Generator(model, TOKENIZER, cuda_graph=True, record_routing=True), max_slots=8,
                    kv_cache_memory_gib=0.05)
    for _ in range(2):  # the second request replays the captured steps
        got = engine.generate(prompts, options)
        assert [c.tokens for c in got] == [c.tokens for c in eager]
        for ours, want in zip(got, eager):
            assert ours.routing is not None and want.routing is not None
            assert torch.equal(ours.routing, want.routing)
