"""MoE routing replay (rl.routing_replay): the sampler records each token's experts, the packed batch carries
them and the training forward routes through them, so the trainer's log-probs of a rollout equal the
sampler's even after a router weight changed the routing (and differ without replay: the test bites)."""

from __future__ import annotations

import pytest
import torch

from fastlm.data.offline_rl import PolicySample
from fastlm.data.tokenizer import ByteTokenizer
from fastlm.generation import Generator, SamplingOptions
from fastlm.generation.engine import Engine
from fastlm.layers.moe import MoEMLP, route
from fastlm.losses.spec import IGNORE_INDEX
from fastlm.models.decoder import DecoderLM, build_model
from fastlm.models.moe_family import MoESettings
from fastlm.models.qwen3_moe.config import Qwen3MoeConfig
from fastlm.rl.packing import pack_policy_samples, policy_logprobs, split_into_batches

TOKENIZER = ByteTokenizer()
TOP_K, EXPERTS = 2, 16


def _moe_model() -> DecoderLM:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, max_seq_len=64,
                            init_std=0.2, moe=MoESettings(num_experts=EXPERTS, top_k=TOP_K, ffn_size=16))
    return build_model(config).eval()


def _rollout(model: DecoderLM) -> tuple[list[PolicySample], list[list[float]]]:
    """Sampled completions with their recorded routing, as the rollout packs them, and the sampler's log-probs."""
    prompts = [TOKENIZER.encode("ab", bos=True), TOKENIZER.encode("hello", bos=True), TOKENIZER.encode("xyz1", bos=True)]
    options = SamplingOptions(6, temperature=1.0)
    completions = Generator(model, TOKENIZER, cuda_graph=False, record_routing=True).generate(
        prompts, options, torch.Generator().manual_seed(3))
    for prompt, completion in zip(prompts, completions):
        assert completion.routing is not None
        assert completion.routing.shape == (len(prompt) + len(completion.tokens), 2, TOP_K)
        assert bool((completion.routing[:-1] >= 0).all()) and bool((completion.routing[-1] == -1).all())
    samples = [PolicySample(p, c.tokens, 0.0, old_logp=c.logprobs, routing=c.routing) for p, c in zip(prompts, completions)]
    return samples, [c.logprobs for c in completions]


def _trainer_logprobs(model: DecoderLM, samples: list[PolicySample], replay: bool) -> torch.Tensor:
    """Every completion token's log-prob from the trainer's forward of the packed batch (label order)."""
    batch = split_into_batches(pack_policy_samples(samples, 40, TOKENIZER.pad_id), 1)[0]
    assert batch.routed_experts is not None and batch.routed_experts.shape == (*batch.input_ids.shape, 2, TOP_K)
    if not replay:
        batch.routed_experts = None
    logp = policy_logprobs(model, batch, 1.0, None)
    return logp[batch.labels != IGNORE_INDEX]


def _steer_router(model: DecoderLM, samples: list[PolicySample]) -> None:
    """Change layer 0's router weight so the routing changes: an expert no token chose takes a multiple of the
    busiest expert's row. Renormalised over the chosen k, the recorded experts' gate weights do not move."""
    layer = model.moe_layers[0]
    chosen = torch.cat([s.routing[:, 0].reshape(-1) for s in samples if s.routing is not None])
    chosen = chosen[chosen >= 0].long()
    counts = torch.bincount(chosen, minlength=EXPERTS)
    idle = int((counts == 0).nonzero()[0])
    with torch.no_grad():
        layer.router.weight[idle] = 50.0 * layer.router.weight[int(counts.argmax())]


def test_replay_makes_the_trainer_route_as_the_sampler_did() -> None:
    model = _moe_model()
    samples, sampler = _rollout(model)
    want = torch.tensor([logp for row in sampler for logp in row])
    assert (_trainer_logprobs(model, samples, replay=True) - want).abs().max() < 1e-5  # same weights: same routing
    _steer_router(model, samples)
    replayed = _trainer_logprobs(model, samples, replay=True)
    fresh = _trainer_logprobs(model, samples, replay=False)
    print(f"max |trainer - sampler|: replay {(replayed - want).abs().max():.2e}, fresh {(fresh - want).abs().max():.2e}")
    assert (replayed - want).abs().max() < 1e-5
    assert (fresh - want).abs().max() > 1e-2  # without replay the changed router routes elsewhere


def test_replayed_routing_trains_the_router() -> None:
    """Only the selection is replayed: the gate weights are the current router's, so the router gets a gradient,
    and a record of -1 keeps the router's own choice."""
    torch.manual_seed(1)
    layer = MoEMLP(8, 4, 6, 2, normalize_top_k=False, backend="loop")
    layer.reset_parameters(0.2, 0.1)
    x = torch.randn(5, 8)
    own = route(x, layer.router.weight, 2, False).experts
    replay = torch.stack([(own[:, 0] + 1) % 6, (own[:, 1] + 2) % 6], dim=1)
    replay[4] = -1
    routing = route(x, layer.router.weight, 2, False, replay=replay)
    assert torch.equal(routing.experts[:4], replay[:4]) and torch.equal(routing.experts[4], own[4])
    assert torch.equal(routing.weights, routing.probs.gather(1, routing.experts))
    layer(x, experts=replay).square().sum().backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("sigmoid", [False, True])
def test_unrecorded_tokens_keep_the_routers_choice(sigmoid: bool) -> None:
    """Records of -1 (a token the sampler never fed back) route as the router does, with its weights up to rounding."""
    torch.manual_seed(2)
    x = torch.randn(7, 8)
    if sigmoid:
        from fastlm.layers.sigmoid_router import SigmoidRouterMoE

        layer: MoEMLP = SigmoidRouterMoE(8, 4, 8, 2, True, n_group=2, topk_group=1)
    else:
        layer = MoEMLP(8, 4, 8, 2, normalize_top_k=True)
    plain = layer.route(x)
    kept = layer.route(x, torch.full((7, 2), -1))
    assert torch.equal(plain.experts, kept.experts) and torch.allclose(plain.weights, kept.weights, rtol=1e-6, atol=0)


def test_activation_checkpointing_recomputes_with_the_replayed_experts() -> None:
    """The backward's recompute of a checkpointed block routes through the same recorded experts."""
    model = _moe_model().train()
    samples, _ = _rollout(model)
    _steer_router(model, samples)
    batch = split_into_batches(pack_policy_samples(samples, 40, TOKENIZER.pad_id), 1)[0]
    grads = []
    for checkpointing in (False, True):
        model.zero_grad()
        model.set_activation_checkpointing(checkpointing)
        hidden = model.hidden_states(batch.input_ids, batch.document_ids, routed_experts=batch.routed_experts)
        hidden.square().sum().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("num_blocks", [None, 14])
def test_the_engine_records_the_static_generators_routing(num_blocks: int | None) -> None:
    """The rollout engine (shared prompt prefills, slots, chunked decode; 14 blocks: preemption and recompute)
    records each token's experts as the static generator does: the same sequences, the same routing."""
    model = _moe_model()
    prompts = [TOKENIZER.encode(text, bos=True) for text in ("ab", "ab", "hello", "xyz1", "xyz1", "q")]
    options = SamplingOptions(10, temperature=1.0)
    static = Generator(model, TOKENIZER, record_routing=True).generate(prompts, options, torch.Generator().manual_seed(4))
    engine = Engine(Generator(model, TOKENIZER, record_routing=True), max_slots=4, block_size=4, num_blocks=num_blocks,
                    check_every=3, prefill_tokens=8)
    got = engine.generate(prompts, options, torch.Generator().manual_seed(4))
    if num_blocks is not None:
        assert engine.admissions > len(prompts), "some sequence was preempted and recomputed"
    for ours, want in zip(got, static):
        assert ours.tokens == want.tokens and ours.routing is not None and want.routing is not None
        assert torch.equal(ours.routing, want.routing)
