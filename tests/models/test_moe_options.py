"""GPT-OSS's MoE options on the shared layer (router bias, expert biases, the clamped SwiGLU) against a
per-token float64 formula, on every backend that runs on the CPU; and the backends that cannot take them
refuse clearly."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from model_helpers import relative_error

from fastlm.layers.moe import MoEMLP, clamped_swiglu, dispatch, route

HIDDEN, FFN, EXPERTS, TOP_K = 16, 8, 4, 2


def gpt_oss_layer(dtype: torch.dtype, backend: str = "loop") -> MoEMLP:
    torch.manual_seed(0)
    layer = MoEMLP(HIDDEN, FFN, EXPERTS, TOP_K, normalize_top_k=True, backend=backend, router_bias=True,  # type: ignore[arg-type]
                   expert_bias=True, activation=partial(clamped_swiglu, alpha=1.702, limit=0.5))
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.normal_(0.0, 0.3)
    return layer.to(dtype)


def naive(layer: MoEMLP, x: torch.Tensor) -> torch.Tensor:
    """Each token: softmax over its top-k biased router logits, then sum_k w_k * expert_k(x) with biases."""
    gate_up, down = layer.expert_weights()
    gate_up_bias, down_bias = layer.gate_up_bias.view(EXPERTS, -1), layer.down_bias.view(EXPERTS, -1)
    logits = x @ layer.router.weight.T + layer.router.bias
    values, experts = logits.topk(TOP_K, dim=-1)
    weights = values.softmax(-1)
    rows = []
    for token in range(x.shape[0]):
        total = torch.zeros(HIDDEN, dtype=x.dtype)
        for slot in range(TOP_K):
            e = int(experts[token, slot])
            h = gate_up[e] @ x[token] + gate_up_bias[e]
            gate, up = h[:FFN].clamp(max=0.5), h[FFN:].clamp(-0.5, 0.5)
            total = total + weights[token, slot] * (down[e] @ ((up + 1) * gate * torch.sigmoid(1.702 * gate)) + down_bias[e])
        rows.append(total)
    return torch.stack(rows)


@pytest.mark.parametrize(("backend", "dtype"), [("loop", torch.float64), ("gather", torch.float64),
                                                ("grouped", torch.float32)])
def test_biased_clamped_experts_match_the_formula(backend: str, dtype: torch.dtype) -> None:
    """Outputs and every parameter's gradient (biases included; the limit is small enough that some gates
    clamp), float64 where the backend takes it (the grouped GEMM: fp32)."""
    reference = gpt_oss_layer(torch.float64)
    layer = gpt_oss_layer(dtype, backend)
    x = torch.randn(6, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = layer(x.to(dtype).requires_grad_())
    expected = naive(reference, x)
    weight = torch.randn_like(expected)
    grads = torch.autograd.grad((out * weight.to(dtype)).sum(), list(layer.parameters()))
    ref_grads = torch.autograd.grad((expected * weight).sum(), list(reference.parameters()))
    errors = [relative_error(out.double(), expected)] + [relative_error(g.double(), r) for g, r in zip(grads, ref_grads)]
    print(f"{backend} {dtype}: rel err out/grads {[f'{e:.1e}' for e in errors]}")
    assert max(errors) < (1e-12 if dtype == torch.float64 else 1e-5)


def test_triton_backend_refuses_biases_and_other_activations() -> None:
    layer = gpt_oss_layer(torch.float32)
    x = torch.randn(4, HIDDEN)
    routing = route(x, layer.router.weight, TOP_K, True, layer.router.bias)
    with pytest.raises(ValueError, match="moe.backend triton has no expert biases"):
        dispatch(x, routing, *layer.expert_weights(), "triton", activation=layer.activation)
