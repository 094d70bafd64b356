"""Multi-head latent attention (fastlm/layers/latent_attention.py) against a float64 reference written from the
DeepSeek-V2 formulas (per-head keys and values expanded from the latent, RoPE on (x0, x1) pairs as complex
rotations, an explicit causal softmax): values and every gradient, then the generation path (the latent cache,
values aliasing the keys) against the training path; and DeepSeek-V3's router against transformers' own."""

from __future__ import annotations

import pytest
import torch
import transformers

from fastlm.layers.kv_cache import CacheMask, KVCache
from fastlm.layers.latent_attention import LatentAttention
from fastlm.layers.packed_attention import attention_layout
from fastlm.layers.rotary import rotary_angles
from fastlm.layers.sigmoid_router import SigmoidRouterMoE

HIDDEN, HEADS, RANK, NOPE, ROPE, V, SEQ = 24, 3, 10, 6, 4, 5, 7


def _attention(q_lora_rank: int | None, interleave: bool) -> LatentAttention:
    torch.manual_seed(0)
    attention = LatentAttention(HIDDEN, HEADS, q_lora_rank, RANK, NOPE, ROPE, V, scale=0.3,
                                rope_interleave=interleave).double()
    with torch.no_grad():
        for parameter in attention.parameters():
            parameter.copy_(torch.randn_like(parameter) * (0.3 if parameter.dim() > 1 else 1.0)
                            + (1.0 if parameter.dim() == 1 else 0.0))
    return attention


def _reference(attention: LatentAttention, x: torch.Tensor, interleave: bool) -> torch.Tensor:
    """softmax(q_h . k_h * scale) v_h per head from the formulas, float64 (the RoPE angle table fp32), RoPE as
    complex rotations."""
    def rms(t: torch.Tensor, norm: torch.nn.RMSNorm) -> torch.Tensor:
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight

    def rope(t: torch.Tensor) -> torch.Tensor:  # (..., S, ROPE)
        # the angle table in fp32, as transformers and fastlm compute it (the only fp32 step)
        positions = torch.arange(SEQ, dtype=torch.float32)[:, None]
        angles = (positions * (1.0 / 10000.0 ** (torch.arange(0, ROPE, 2, dtype=torch.float32) / ROPE)))
        turn = torch.complex(angles.cos().double(), angles.sin().double())
        pairs = torch.stack((t[..., 0::2], t[..., 1::2]), -1) if interleave else \
            torch.stack((t[..., : ROPE // 2], t[..., ROPE // 2:]), -1)
        rotated = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * turn)
        return torch.cat((rotated[..., 0], rotated[..., 1]), -1)  # half-split layout, as both implementations

    q = x @ attention.q_proj.weight.T if attention.q_proj is not None else \
        rms(x @ attention.q_a_proj.weight.T, attention.q_a_norm) @ attention.q_b_proj.weight.T
    q = q.view(1, SEQ, HEADS, NOPE + ROPE).transpose(1, 2)
    compressed = x @ attention.kv_a_proj.weight.T
    latent, k_rope = rms(compressed[..., :RANK], attention.kv_a_norm), compressed[..., RANK:]
    kv = (latent @ attention.kv_b_proj.weight.T).view(1, SEQ, HEADS, NOPE + V).transpose(1, 2)
    keys = torch.cat((kv[..., :NOPE], rope(k_rope)[:, None].expand(-1, HEADS, -1, -1)), -1)
    queries = torch.cat((q[..., :NOPE], rope(q[..., NOPE:])), -1)
    scores = queries @ keys.transpose(-1, -2) * attention.scale
    scores = scores.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))
    out = scores.softmax(-1) @ kv[..., NOPE:]
    return out.transpose(1, 2).reshape(1, SEQ, HEADS * V) @ attention.out_proj.weight.T


@pytest.mark.parametrize(("q_lora_rank", "interleave"), [(None, True), (8, False)])
def test_values_and_gradients_equal_the_float64_reference(q_lora_rank: int | None, interleave: bool) -> None:
    attention = _attention(q_lora_rank, interleave)
    x = torch.randn(1, SEQ, HIDDEN, dtype=torch.float64, requires_grad=True)
    rotary = rotary_angles(torch.arange(SEQ)[None], ROPE, 10000.0)
    rotary = (rotary[0].double(), rotary[1].double())
    layout = attention_layout(1, SEQ, None, None, x.device, False, "dense")
    ours = attention(x, rotary, layout)
    theirs = _reference(attention, x, interleave)
    grad_out = torch.randn_like(ours)
    ours_grads = torch.autograd.grad(ours, [x, *attention.parameters()], grad_out)
    theirs_grads = torch.autograd.grad(theirs, [x, *attention.parameters()], grad_out)
    value = float((ours - theirs).norm() / theirs.norm())
    worst = max(float((a - b).norm() / b.norm()) for a, b in zip(ours_grads, theirs_grads))
    print(f"q_lora {q_lora_rank}, interleave {interleave}: value rel err {value:.1e}, worst gradient rel err "
          f"{worst:.1e} over {len(ours_grads)} tensors")
    assert value < 1e-12 and worst < 1e-12


def test_latent_cache_holds_one_row_per_token_and_equals_the_training_path() -> None:
    """The cache stores kv_lora_rank + rope numbers per token and layer (values are views of the keys), and
    attending through it (absorbed key/value expansion) gives the training path's output in float64."""
    attention = _attention(8, True)
    x = torch.randn(2, SEQ, HIDDEN, dtype=torch.float64)
    cache = KVCache(1, 2, HEADS, 1, SEQ, RANK + ROPE, torch.float64, "cpu", uniform_columns=True, value_dim=RANK)
    assert cache.values[0].data_ptr() == cache.keys[0].data_ptr()  # views: one buffer per layer
    assert cache.keys[0].shape == (2, 1, SEQ, RANK + ROPE) and cache.values[0].shape == (2, 1, SEQ, RANK)
    columns = torch.arange(SEQ).expand(2, SEQ)
    rotary = rotary_angles(cache.positions(columns), ROPE, 10000.0)
    rotary = (rotary[0].double(), rotary[1].double())
    mask = CacheMask(additive=cache.mask(columns, SEQ, None))
    cached = attention(x, rotary, None, cache.layer(0, columns, SEQ, mask))
    trained = attention(x, rotary, attention_layout(2, SEQ, None, None, x.device, False, "dense"))
    error = float((cached - trained).norm() / trained.norm())
    print(f"latent cache vs expanded keys and values: float64 rel err {error:.1e}")
    assert error < 1e-12


def test_sigmoid_router_equals_transformers() -> None:
    """Chosen experts and their weights against transformers' DeepseekV3TopkRouter (8 experts in 4 groups of which
    2 are kept, a random correction bias), in fp32: transformers' router runs in fp32 whatever the model's dtype."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = transformers.DeepseekV3Config(hidden_size=16, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                                           topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    theirs = DeepseekV3TopkRouter(config)
    ours = SigmoidRouterMoE(16, 8, 8, 3, True, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    torch.manual_seed(1)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(8, 16))
        theirs.e_score_correction_bias.copy_(0.3 * torch.randn(8))
        ours.router.weight.copy_(theirs.weight)
        ours.e_score_correction_bias.copy_(theirs.e_score_correction_bias)
    x = torch.randn(50, 16)
    _, weights, experts = theirs(x)
    routing = ours.route(x)
    order, our_order = experts.argsort(-1), routing.experts.argsort(-1)
    assert torch.equal(experts.gather(1, order), routing.experts.gather(1, our_order))
    assert torch.allclose(weights.gather(1, order), routing.weights.gather(1, our_order), rtol=1e-6, atol=0)
