"""The KV-cache path of the decoder against its uncached forward, for every architecture.

Float64 models: the cached forward (prefill + one-token decode steps over a left- or right-padded batch)
must give the uncached forward's hidden states, and cached greedy decoding the tokens of a plain
re-run-the-prefix loop. Presets: GPT-2 (learned positions), Llama (RoPE, GQA), Qwen2 (qkv bias),
Mistral (sliding window, shrunk so the prompts cross it).
"""

from __future__ import annotations

import pytest
import torch

from fastlm.data.tokenizer import ByteTokenizer
from fastlm.generation import Generator, SamplingOptions
from fastlm.layers.kv_cache import KVCache
from tests.models.model_helpers import load_preset, make_model, relative_error

ARCHITECTURES = {
    "tiny-gpt2": {},
    "tiny-llama": {},
    "qwen2-tiny": {},
    "mistral-tiny": {"sliding_window": 6},
}


def _model(name: str):
    config = load_preset(name).model_copy(update={"num_layers": 2, "max_seq_len": 64, **ARCHITECTURES[name]})
    return make_model(config, dtype=torch.float64, seed=len(name))


def _prompts(seed: int, count: int = 4) -> list[list[int]]:
    rng = torch.Generator().manual_seed(seed)
    lengths = [3, 11, 7, 1, 9][:count]
    return [torch.randint(0, 256, (n,), generator=rng).tolist() for n in lengths]


def _uncached_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    sequence, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            logp = torch.log_softmax(model.logits(torch.tensor([sequence]))[0, -1], dim=-1)
            token = int(logp.argmax())
            sequence.append(token)
            logprobs.append(float(logp[token]))
    return sequence[len(prompt):], logprobs


@pytest.mark.parametrize("name", list(ARCHITECTURES))
@pytest.mark.parametrize("padding", ["left", "right"])
def test_cached_forward_equals_uncached(name: str, padding: str) -> None:
    """Teacher-forced: prefill the prompts, then feed a fixed continuation one token per step."""
    model = _model(name)
    prompts = _prompts(1)
    continuation = torch.randint(0, 256, (len(prompts), 6), generator=torch.Generator().manual_seed(2))
    width = max(len(p) for p in prompts)
    config = model.config
    kv_heads = config.kv_heads
    cache = KVCache(config.num_layers, len(prompts), config.num_heads, kv_heads, width + 6, config.head_dim,
                    torch.float64, "cpu", uniform_columns=padding == "left")
    tokens = torch.zeros(len(prompts), width, dtype=torch.int64)
    lengths = torch.tensor([len(p) for p in prompts])
    for row, prompt in enumerate(prompts):
        place = slice(width - len(prompt), width) if padding == "left" else slice(0, len(prompt))
        tokens[row, place] = torch.tensor(prompt)
    cache.start.copy_(width - lengths if padding == "left" else torch.zeros_like(lengths))
    with torch.no_grad():
        prefill = model.cached_hidden_states(tokens, cache, torch.arange(width).expand(len(prompts), width), width)
        columns = (torch.full_like(lengths, width) if padding == "left" else lengths)[:, None]
        steps = []
        for index in range(continuation.shape[1]):
            steps.append(model.cached_hidden_states(continuation[:, index : index + 1], cache, columns + index, cache.length))
    worst = 0.0
    for row, prompt in enumerate(prompts):
        sequence = torch.tensor([prompt + continuation[row].tolist()])
        with torch.no_grad():
            want = model.hidden_states(sequence)[0]
        got_prompt = prefill[row, width - len(prompt):] if padding == "left" else prefill[row, : len(prompt)]
        got = torch.cat([got_prompt] + [s[row] for s in steps])
        worst = max(worst, relative_error(got, want))
    print(f"{name} ({padding} padding): cached vs uncached hidden states, worst rel err {worst:.2e}")
    assert worst < 1e-12


@pytest.mark.parametrize(("name", "attention"), [(name, "sdpa") for name in ARCHITECTURES] + [("mistral-tiny", "flex")])
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_cached_greedy_equals_uncached_loop(name: str, attention: str) -> None:
    """SDPA decode for every architecture; FlexAttention decode (the graph path's) on Mistral (GQA, RoPE,
    window: every part of its mask_mod). On CPU FlexAttention is its unfused float64 reference, a few
    seconds of tracing per step: which blocks it reads is checked by
    test_decode_block_mask_lists_the_visible_blocks, the fused kernel on GPU."""
    model = _model(name)
    prompts = _prompts(3, count=5)
    options = SamplingOptions(max_new_tokens=12, temperature=0.0)
    for padding in ("left", "right"):
        engine = Generator(model, ByteTokenizer(), padding=padding, decode_attention=attention)
        completions = engine.generate(prompts, options)
        worst = 0.0
        for prompt, completion in zip(prompts, completions):
            tokens, logprobs = _uncached_greedy(model, prompt, 12)
            assert completion.tokens == tokens and not completion.stopped
            worst = max(worst, relative_error(torch.tensor(completion.logprobs, dtype=torch.float64), torch.tensor(logprobs)))
        print(f"{name} ({padding}, {attention}): greedy tokens equal, log-prob rel err {worst:.2e}")
        assert worst < 1e-6  # the sampler works in float32


@pytest.mark.parametrize("window", [None, 70])
@pytest.mark.parametrize("uniform", [True, False])
def test_decode_block_mask_lists_the_visible_blocks(window: int | None, uniform: bool) -> None:
    """The decode block mask lists exactly the key blocks holding a visible column (skipped blocks are
    never read by the kernel), and its mask_mod equals the additive mask, for left and right padding."""
    from fastlm.layers.kv_cache import DECODE_KEY_BLOCK

    rng = torch.Generator().manual_seed(7)
    batch, length = 6, 5 * DECODE_KEY_BLOCK - 8  # a partial last block
    cache = KVCache(1, batch, 4, 2, length, 8, torch.float32, "cpu", uniform_columns=uniform, decode_attention="flex")
    for _ in range(20):
        if uniform:  # left padding: every row at the same column, starts before it
            own = torch.randint(1, length, (1,), generator=rng).expand(batch)
            start = (own * torch.rand(batch, generator=rng)).long()
        else:  # right padding: starts at 0, own columns differ
            own = torch.randint(0, length, (batch,), generator=rng)
            start = torch.zeros(batch, dtype=torch.int64)
        cache.start.copy_(start)
        columns = own[:, None].clone()
        visible = cache.mask(columns, length, window)[:, 0, 0] == 0  # (B, length): query row of the first head group
        block_mask = cache.attention_mask(columns, length, window).blocks
        assert block_mask is not None
        counts, indices = block_mask.kv_num_blocks[:, 0, 0], block_mask.kv_indices[:, 0, 0]
        blocks = -(-length // DECODE_KEY_BLOCK)
        padded = torch.nn.functional.pad(visible, (0, blocks * DECODE_KEY_BLOCK - length))
        needed = padded.view(batch, blocks, DECODE_KEY_BLOCK).any(-1)
        for row in range(batch):
            listed = set(indices[row, : counts[row]].tolist())
            assert listed == set(needed[row].nonzero().flatten().tolist()), (row, start[row], own[row], listed)
        keys = torch.arange(length)
        rows = torch.arange(batch)[:, None]
        modded = block_mask.mask_mod(rows, torch.zeros_like(rows), torch.zeros_like(rows), keys[None])
        assert torch.equal(modded, visible)


def test_replica_path_matches_live_model() -> None:
    """The graph path's weight replica (here float32 on CPU, no graph) gives the live model's tokens."""
    model = _model("tiny-llama").float()
    prompts = _prompts(5)
    options = SamplingOptions(max_new_tokens=8, temperature=0.0)
    live = Generator(model, ByteTokenizer()).generate(prompts, options)
    engine = Generator(model, ByteTokenizer())
    engine.sync_weights()
    replica_step = engine._decode_step(engine.replica, engine.head_weight, len(prompts), 32, options)
    replica = engine._generate(engine.replica, engine.head_weight, replica_step, prompts, None,
                               max(len(p) for p in prompts))
    assert [c.tokens for c in replica] == [c.tokens for c in live]
    with torch.no_grad():
        model.blocks[0].mlp_norm.weight.mul_(3.0)  # a weight update reaches the replica on the next sync
    engine.sync_weights()
    assert torch.equal(engine.replica.blocks[0].mlp_norm.weight, model.blocks[0].mlp_norm.weight)
