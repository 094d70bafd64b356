"""Gated DeltaNet (fastlm/layers/gated_deltanet.py) against float64 references: the chunked rule against a
plain per-token loop (values and gradients, grouped heads, chunk boundaries, an initial state), packed
documents against each document alone, the cache path (prefill + decode, padding ignored) against the
training forward, and, on CUDA, fla-core's kernel against the PyTorch form."""

from __future__ import annotations

import pytest
import torch

from fastlm.layers.gated_deltanet import (
    GatedDeltaNet,
    causal_conv,
    chunked_gated_delta_rule,
    gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
)
from fastlm.layers.kv_cache import RecurrentLayerCache
from fastlm.layers.packed_attention import attention_layout


def _inputs(steps: int, batch: int = 2, heads: int = 3, key_dim: int = 8, value_dim: int = 6, seed: int = 0,
            dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=dtype)

    q, k = draw(batch, steps, heads, key_dim), draw(batch, steps, heads, key_dim)
    v = draw(batch, steps, heads, value_dim)
    g = -torch.nn.functional.softplus(draw(batch, steps, heads))  # log decays <= 0
    beta = torch.sigmoid(draw(batch, steps, heads))
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def loop_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule as written in the papers, one (batch, head) at a time, float64: S <- a S (I - b k k^T) + b k v^T."""
    batch, steps, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    rows, finals = [], []
    for row in range(batch):
        per_head, head_states = [], []
        for head in range(heads):
            s = torch.zeros(key_dim, value_dim, dtype=torch.float64) if state is None else state[row, head].double()
            outputs = []
            for t in range(steps):
                kt, vt, qt = k[row, t, head].double(), v[row, t, head].double(), q[row, t, head].double()
                a, b = g[row, t, head].double().exp(), beta[row, t, head].double()
                s = a * (torch.eye(key_dim, dtype=torch.float64) - b * torch.outer(kt, kt)) @ s + b * torch.outer(kt, vt)
                outputs.append(s.T @ qt / key_dim**0.5)
            per_head.append(torch.stack(outputs))
            head_states.append(s)
        rows.append(torch.stack(per_head, dim=1))
        finals.append(torch.stack(head_states))
    return torch.stack(rows), torch.stack(finals)


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach(), expected.detach()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


@pytest.mark.parametrize("steps", [5, 64, 150])
def test_chunked_and_recurrent_forms_equal_the_loop_values_and_gradients(steps: int) -> None:
    """Over 0, 1 and 3 chunk boundaries, with an initial state; gradients of q, k, v, g, beta and the state."""
    inputs = _inputs(steps)
    q, k = l2_normalize(inputs[0]), l2_normalize(inputs[1])
    state = torch.randn(2, 3, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(9)).requires_grad_()
    weights = torch.randn(2, steps, 3, 6, dtype=torch.float64)
    expected, expected_state = loop_reference(q, k, *inputs[2:], state)
    reference = torch.autograd.grad((expected * weights).sum() + expected_state.sum(), [*inputs, state],
                                    retain_graph=True)
    for form in (chunked_gated_delta_rule, recurrent_gated_delta_rule):
        out, final = form(q, k, *inputs[2:], state)
        out_error, state_error = _relative(out, expected), _relative(final, expected_state)
        grads = torch.autograd.grad((out * weights).sum() + final.sum(), [*inputs, state], retain_graph=True)
        grad_error = max(_relative(a, b) for a, b in zip(grads, reference))
        print(f"{form.__name__} T={steps}: out rel err {out_error:.1e}, state {state_error:.1e}, "
              f"worst grad {grad_error:.1e}")
        assert out_error < 1e-12 and state_error < 1e-12 and grad_error < 1e-11


def test_packed_documents_restart_the_state_like_each_document_alone() -> None:
    """Documents cut at every position 0 (fla's cu_seqlens); values and gradients against running each alone."""
    lengths = [(7, 70, 3), (80,)]
    steps = 80
    inputs = _inputs(steps)
    positions = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths])
    layout = attention_layout(2, steps, positions, None, torch.device("cpu"))
    packed, _ = gated_delta_rule(*inputs, kernel="torch", segments=layout.segments)
    alone = []
    for row, row_lengths in enumerate(lengths):
        start, pieces = 0, []
        for n in row_lengths:
            piece = [x[row:row + 1, start:start + n] for x in inputs]
            q, k = l2_normalize(piece[0]), l2_normalize(piece[1])
            pieces.append(loop_reference(q, k, *piece[2:])[0])
            start += n
        alone.append(torch.cat(pieces, dim=1))
    expected = torch.cat(alone)
    weights = torch.randn_like(expected)
    grads = torch.autograd.grad((packed * weights).sum(), inputs)
    reference = torch.autograd.grad((expected * weights).sum(), inputs)
    error, grad_error = _relative(packed, expected), max(_relative(a, b) for a, b in zip(grads, reference))
    print(f"packed documents: out rel err {error:.1e}, worst grad {grad_error:.1e}")
    assert error < 1e-12 and grad_error < 1e-11


def test_causal_conv_restarts_per_document_and_continues_from_a_window() -> None:
    x = torch.randn(1, 9, 5, dtype=torch.float64)
    weight = torch.randn(5, 4, dtype=torch.float64)

    def conv(piece: torch.Tensor) -> torch.Tensor:  # torch's own depthwise conv, left-padded
        out = torch.nn.functional.conv1d(piece.transpose(1, 2), weight[:, None], padding=3, groups=5)
        return out[..., : piece.shape[1]].transpose(1, 2)

    positions = torch.cat([torch.arange(4), torch.arange(5)])[None]
    packed = causal_conv(x, weight, positions)
    assert torch.allclose(packed, torch.cat([conv(x[:, :4]), conv(x[:, 4:])], dim=1), atol=1e-13)
    continued = causal_conv(x[:, 6:], weight, None, x[:, 3:6])
    assert torch.allclose(continued, conv(x)[:, 6:], atol=1e-13)


def _layer(fused: bool = False) -> GatedDeltaNet:
    torch.manual_seed(3)
    layer = GatedDeltaNet(16, key_heads=2, value_heads=4, key_head_dim=8, value_head_dim=6, conv_kernel=4,
                          norm_eps=1e-6, fused_projections=fused, kernel="torch").double()
    layer.reset_parameters(0.2, 0.2)
    return layer


@pytest.mark.parametrize("fused", [False, True])
def test_cache_prefill_and_decode_equal_the_training_forward(fused: bool) -> None:
    """Left-padded prefill (pads ignored), then decode steps one token at a time, a finished (frozen) row
    untouched: each real token's output equals the training forward on the row's real tokens alone."""
    layer = _layer(fused)
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    pads = torch.tensor([3, 0])  # row 0 starts at column 3
    conv = torch.zeros(2, 3, layer.conv_channels, dtype=torch.float64)
    state = torch.zeros(2, 4, 8, 6, dtype=torch.float64)
    prefill = 6
    columns = torch.arange(prefill).expand(2, prefill)
    real = columns >= pads[:, None]
    with torch.no_grad():
        cached = [layer(x[:, :prefill], None, None, RecurrentLayerCache(conv, state, real, columns[:, 0] != 0))]
        for column in range(prefill, 10):
            step = RecurrentLayerCache(conv, state, torch.ones(2, 1, dtype=torch.bool), torch.ones(2, dtype=torch.bool))
            cached.append(layer(x[:, column:column + 1], None, None, step))
        out = torch.cat(cached, dim=1)
        for row in range(2):
            alone = layer(x[row:row + 1, pads[row]:], None, attention_layout(1, 10 - int(pads[row]), None, None,
                                                                            x.device))
            error = float((out[row, pads[row]:] - alone[0]).abs().max())
            print(f"row {row}: cached vs training forward max abs err {error:.1e}")
            assert error < 1e-12
        frozen = state.clone(), conv.clone()
        layer(x[:, :1], None, None, RecurrentLayerCache(conv, state, torch.zeros(2, 1, dtype=torch.bool),
                                                        torch.ones(2, dtype=torch.bool)))
        assert torch.equal(state, frozen[0]) and torch.equal(conv, frozen[1])


def test_layer_gradients_packed_against_documents_alone() -> None:
    """The whole layer (conv, gates, norm) on a packed row: gradients of every parameter equal the sum of
    each document's own run."""
    layer = _layer()
    x = torch.randn(1, 12, 16, dtype=torch.float64)
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
    layout = attention_layout(1, 12, positions, None, x.device)
    packed = layer(x, None, layout)
    weights = torch.randn_like(packed)
    grads = torch.autograd.grad((packed * weights).sum(), list(layer.parameters()))
    alone = torch.cat([layer(x[:, :5], None, attention_layout(1, 5, None, None, x.device)),
                       layer(x[:, 5:], None, attention_layout(1, 7, None, None, x.device))], dim=1)
    reference = torch.autograd.grad((alone * weights).sum(), list(layer.parameters()))
    assert float((packed - alone).abs().max()) < 1e-12
    assert max(_relative(a, b) for a, b in zip(grads, reference)) < 1e-11


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_kernel_matches_the_torch_form_on_cuda() -> None:
    """fla-core's chunked kernel (bf16 in, fp32 state) against the PyTorch form in fp32, packed documents
    and plain rows, grouped value heads (2 q/k heads for 4 value heads), values and gradients."""
    pytest.importorskip("fla")
    inputs = [t.detach().float().cuda() for t in _inputs(300, heads=4, key_dim=64, value_dim=64)]
    inputs[0], inputs[1] = inputs[0][:, :, :2].contiguous(), inputs[1][:, :, :2].contiguous()
    positions = torch.cat([torch.arange(100), torch.arange(200)])[None].expand(2, 300).cuda()
    for packed in (None, attention_layout(2, 300, positions, None, positions.device).segments):
        ours = [t.clone().requires_grad_() for t in inputs]
        theirs = [t.clone().bfloat16().requires_grad_() if i < 3 else t.clone().requires_grad_()
                  for i, t in enumerate(inputs)]
        expected, _ = gated_delta_rule(*ours, kernel="torch", segments=packed)
        actual, _ = gated_delta_rule(*theirs, kernel="fla", segments=packed)
        weights = torch.randn_like(expected)
        grads = torch.autograd.grad((actual.float() * weights).sum(), theirs)
        reference = torch.autograd.grad((expected * weights).sum(), ours)
        error = _relative(actual.float(), expected)
        grad_error = max(_relative(a.float(), b) for a, b in zip(grads, reference))
        print(f"fla vs torch (packed={packed is not None}): out rel err {error:.1e}, worst grad {grad_error:.1e}")
        assert error < 2e-2 and grad_error < 5e-2
