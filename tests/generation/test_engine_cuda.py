"""The engine's CUDA path: slot-bucket decode steps captured in CUDA graphs (FlexAttention paged decode, optionally
compiled) on a float32 replica against the static generator run eagerly, and the paged flex decode kernel
against the gather path in bf16."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (CUDA graphs, the FlexAttention paged decode kernel)", allow_module_level=True)

from fastlm.data.tokenizer import EOS, ByteTokenizer
from fastlm.generation import Generator, SamplingOptions
from fastlm.generation.engine import Engine
from fastlm.generation.paged_cache import PagedKVCache
from tests.models.model_helpers import load_preset, make_model, relative_error

TOKENIZER = ByteTokenizer()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield


def _prompts() -> list[list[int]]:
    rng = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (n,), generator=rng).tolist() for n in (1, 17, 70, 100, 33, 64)]
    return [p for p in prompts for _ in range(3)]  # 18 sequences, 3 per prompt


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "compile"), [("tiny-llama", False), ("gemma3-tiny", False), ("tiny-llama", True)])
def test_engine_graphs_match_the_static_eager_path(name: str, compile: bool) -> None:
    """32 slots (buckets 32 and 8) for 18 sequences with stop tokens, float32: the same tokens as the static
    generator's eager path, log-probs within float32 rounding, the steps captured and not fallen back."""
    config = load_preset(name).model_copy(update={"num_layers": 2})
    model = make_model(config, dtype=torch.float32, seed=3).cuda()
    prompts, options = _prompts(), SamplingOptions(80, temperature=1.0, stop_tokens=(EOS, 101, 102))
    want = Generator(model, TOKENIZER, cuda_graph=False).generate(prompts, options, torch.Generator("cuda").manual_seed(5))
    engine = Engine(Generator(model, TOKENIZER, cuda_graph=True, compile=compile), max_slots=32, block_size=64,
                    kv_cache_memory_gib=0.05)
    got = engine.generate(prompts, options, torch.Generator("cuda").manual_seed(5))
    assert engine.graphs and engine.cache is not None and engine.cache.decode_attention == "flex", "fell back"
    assert all(step.graph is not None for step in engine.steps.values())
    same = sum(a.tokens == b.tokens for a, b in zip(want, got))
    errors = [abs(x - y) for a, b in zip(want, got) if a.tokens == b.tokens for x, y in zip(a.logprobs, b.logprobs)]
    print(f"{name} (compile={compile}): {same}/{len(want)} completions equal, max |logprob diff| {max(errors):.2e}, "
          f"lengths {[len(c.tokens) for c in got]}, buckets {sorted(k[0] for k in engine.steps)}")
    assert same == len(want) and max(errors) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 100])
def test_paged_flex_kernel_matches_the_gather_path(window: int | None) -> None:
    """The compiled FlexAttention paged decode (bf16, 64-token blocks, rows sharing blocks) against gather + SDPA."""
    generator = torch.Generator().manual_seed(0)
    size, blocks, heads, kv_heads, dim, rows = 64, 40, 8, 2, 64, 6
    caches = [PagedKVCache([0], [window], heads, kv_heads, dim, size, blocks, torch.bfloat16, "cuda", decode_attention=kind)
              for kind in ("sdpa", "flex")]
    pool = torch.randn(2, 1, kv_heads, blocks * size, dim, generator=generator).to(torch.bfloat16).cuda()
    table = torch.randperm(blocks - 1, generator=generator)[: rows * 6].view(rows, 6) + 1
    table[1, :3] = table[0, :3]  # shared prompt blocks
    table = table.cuda()
    columns = torch.tensor([[300], [200], [5], [64], [383], [130]]).cuda()
    q, k, v = (torch.randn(rows, h, 1, dim, generator=generator).to(torch.bfloat16).cuda()
               for h in (heads, kv_heads, kv_heads))
    outputs = []
    for cache in caches:
        cache.keys[0].copy_(pool[0])
        cache.values[0].copy_(pool[1])
        cache.bind([table])
        mask = cache.attention_mask(columns, 0, window)
        outputs.append(cache.layer(0, columns, 0, mask).attend(q, k, v).float())
    error = relative_error(outputs[1], outputs[0])
    print(f"paged flex (window {window}) vs gather: rel err {error:.2e}")
    assert error < 1e-2
