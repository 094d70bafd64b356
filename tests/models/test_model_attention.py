"""Attention against a naive float64 softmax(QK^T/sqrt(d) + mask)V, masks against loops, GQA against MHA.

Every layout (SDPA causal, SDPA dense mask, FlexAttention block mask; the latter through its unfused
CPU kernel, which runs float64) is checked against the same naive formula.
"""

from __future__ import annotations

import math

import pytest
import torch
from model_helpers import relative_error

from fastlm.layers.attention import Attention
from fastlm.layers.attention_kernels import FLEX_MIN_HEAD_DIM, attention_mask
from fastlm.layers.embedding import document_positions
from fastlm.layers.kv_cache import KVCache, decode_attention_for
from fastlm.layers.packed_attention import attention_layout, packed_kind

DOCS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 3, 3]])


def naive_mask(document_ids: torch.Tensor | None, seq_len: int, window: int | None) -> torch.Tensor:
    """Loop version: causal, same contiguous document, within the window (incl. the token itself)."""
    batch = 1 if document_ids is None else document_ids.shape[0]
    mask = torch.zeros(batch, 1, seq_len, seq_len, dtype=torch.bool)
    for b in range(batch):
        for i in range(seq_len):
            for j in range(i + 1):
                same = document_ids is None or bool((document_ids[b, j : i + 1] == document_ids[b, i]).all())
                mask[b, 0, i, j] = same and (window is None or i - j < window)
    return mask


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


def test_document_positions_restart_per_contiguous_run() -> None:
    ids = torch.tensor([[4, 4, 7, 7, 7, 4, 4], [1, 1, 1, 1, 1, 1, 1]])
    expected = torch.tensor([[0, 1, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 5, 6]])
    assert torch.equal(document_positions(ids), expected)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("with_docs", [False, True])
def test_attention_mask_matches_loop(with_docs: bool, window: int | None) -> None:
    docs = DOCS if with_docs else None
    seq_len = DOCS.shape[1]
    positions = None if docs is None else document_positions(docs)
    mask = attention_mask(seq_len, positions, window, torch.device("cpu"))
    if docs is None and window is None:
        assert mask is None  # the is_causal fast path
        return
    assert torch.equal(mask.expand(naive_mask(docs, seq_len, window).shape), naive_mask(docs, seq_len, window))


LAYOUT_CASES = [
    ("causal", "causal"),
    ("dense", "documents"), ("dense", "window"), ("dense", "documents+window"),
    ("flex", "causal"), ("flex", "documents"), ("flex", "window"), ("flex", "documents+window"),
]


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize(
    ("kind", "case", "dtype"),
    # FlexAttention's CPU kernel is the unfused reference: float64 is the informative check there.
    [(kind, case, dtype) for kind, case in LAYOUT_CASES for dtype in (torch.float64, torch.float32)
     if kind != "flex" or dtype == torch.float64],
)
def test_layouts_match_naive_float64(kind: str, kv_heads: int, case: str, dtype: torch.dtype) -> None:
    """Each layout (SDPA is_causal + enable_gqa, SDPA dense mask + enable_gqa, FlexAttention block mask
    + enable_gqa) in float64 and float32 against the naive formula in float64, forward and gradients.
    FlexAttention has no CPU backward: its gradients are checked on CUDA (tests/models/test_packed_attention_cuda.py)."""
    torch.manual_seed(kv_heads)
    batch, heads, seq_len, dim = 2, 4, DOCS.shape[1], 8
    q = torch.randn(batch, heads, seq_len, dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq_len, dim, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq_len, dim, dtype=torch.float64, requires_grad=True)
    docs = DOCS if "documents" in case else None
    window = 4 if "window" in case else None
    positions = None if docs is None else document_positions(docs)
    layout = attention_layout(batch, seq_len, positions, window, q.device, kind=kind, head_dim=dim)
    weight = torch.randn(batch, heads, seq_len, dim, dtype=torch.float64)

    with_grad = kind != "flex"
    inputs = [t.detach().to(dtype).requires_grad_(with_grad) for t in (q, k, v)]
    out = layout.attend(*inputs)
    ref = naive_attention(q, k, v, naive_mask(docs, seq_len, window))
    errors = [relative_error(out, ref)]
    if with_grad:
        grads = torch.autograd.grad((out * weight.to(dtype)).sum(), inputs)
        ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))
        errors += [relative_error(g, r) for g, r in zip(grads, ref_grads)]
    print(f"{kind} {case} kv_heads={kv_heads} {dtype}: rel err out[/dq/dk/dv] = {[f'{e:.2e}' for e in errors]}")
    assert max(errors) < (1e-12 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("with_docs", [False, True])
def test_gqa_equals_mha_with_repeated_kv_heads(with_docs: bool) -> None:
    """A 4q/2kv attention equals a 4q/4kv one whose k/v projections repeat each kv head per group."""
    torch.manual_seed(1)
    hidden, heads, kv_heads, head_dim = 32, 4, 2, 8
    gqa = Attention(hidden, heads, kv_heads, qkv_bias=True, out_bias=False, dropout=0.0).double()
    mha = Attention(hidden, heads, heads, qkv_bias=True, out_bias=False, dropout=0.0).double()
    with torch.no_grad():
        gqa.qkv_proj.bias.normal_()
        q_w, k_w, v_w = gqa.qkv_proj.weight.split(gqa.split_sizes)
        q_b, k_b, v_b = gqa.qkv_proj.bias.split(gqa.split_sizes)

        def repeat(t: torch.Tensor) -> torch.Tensor:
            return t.view(kv_heads, head_dim, *t.shape[1:]).repeat_interleave(heads // kv_heads, 0).flatten(0, 1)

        mha.qkv_proj.weight.copy_(torch.cat([q_w, repeat(k_w), repeat(v_w)]))
        mha.qkv_proj.bias.copy_(torch.cat([q_b, repeat(k_b), repeat(v_b)]))
        mha.out_proj.weight.copy_(gqa.out_proj.weight)
    x = torch.randn(2, DOCS.shape[1], hidden, dtype=torch.float64)
    positions = document_positions(DOCS) if with_docs else None
    layout = attention_layout(2, DOCS.shape[1], positions, None, x.device, head_dim=hidden // 4)
    error = relative_error(gqa(x, None, layout), mha(x, None, layout))
    print(f"GQA vs repeated-kv MHA (documents={with_docs}): rel err {error:.2e}")
    assert error < 1e-12


def test_attention_rejects_heads_not_divisible() -> None:
    with pytest.raises(ValueError, match="num_kv_heads"):
        Attention(32, 4, 3, qkv_bias=False, out_bias=False, dropout=0.0)


def test_causal_layout_rejects_masks() -> None:
    with pytest.raises(ValueError, match="causal layout"):
        attention_layout(2, DOCS.shape[1], document_positions(DOCS), None, torch.device("cpu"), kind="causal")


def test_small_heads_on_cuda_take_sdpa_instead_of_flex() -> None:
    """FlexAttention's CUDA kernels refuse heads under 16 (an InductorError, "must be at least 16 but got
    E=8"): packed training rows take the dense mask and the KV cache's decode SDPA there; CPU keeps what
    the caller asked for (the unfused reference the tests compare)."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert FLEX_MIN_HEAD_DIM == 16
    assert packed_kind(cuda, 8) == "dense" and packed_kind(cuda, 15) == "dense"
    assert packed_kind(cuda, 16) == "flex" and packed_kind(cuda, 128) == "flex"
    assert packed_kind(cuda, 64, dropout_active=True) == "dense" and packed_kind(cpu, 64) == "dense"
    assert decode_attention_for("flex", cuda, 8) == "sdpa" and decode_attention_for("flex", cuda, 16) == "flex"
    assert decode_attention_for("flex", cpu, 8) == "flex" and decode_attention_for("sdpa", cuda, 64) == "sdpa"
    assert KVCache(1, 1, 2, 1, 8, 8, torch.float32, "cpu", decode_attention="flex").decode_attention == "flex"


def test_layout_choice() -> None:
    """Plain causal rows take flash-capable is_causal; masked rows on CPU the dense mask; dropout never flex."""
    cpu, positions = torch.device("cpu"), document_positions(DOCS)
    assert attention_layout(2, 12, None, None, cpu, head_dim=16).kind == "causal"
    assert attention_layout(2, 12, positions, None, cpu, head_dim=16).kind == "dense"
    assert attention_layout(2, 12, None, 4, cpu, head_dim=16).kind == "dense"
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        assert attention_layout(2, 12, positions.cuda(), 4, cuda, head_dim=16).kind == "flex"
        assert attention_layout(2, 12, positions.cuda(), None, cuda, dropout_active=True, head_dim=16).kind == "dense"
        assert attention_layout(2, 12, positions.cuda(), None, cuda, head_dim=8).kind == "dense"


def naive_capped_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                                softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """The formula written out: p_j = exp(c(s_j)) / (sum_i exp(c(s_i)) + exp(sink)), c the softcap."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    weights = scores.exp() * mask
    denominator = weights.sum(-1, keepdim=True)
    if sinks is not None:
        denominator = denominator + sinks.exp().view(1, -1, 1, 1)
    return weights / denominator @ v


@pytest.mark.parametrize("kind", ["causal", "dense", "flex"])
@pytest.mark.parametrize(("softcap", "with_sinks"), [(2.0, False), (None, True), (3.0, True)])
def test_softcap_and_sinks_match_naive_float64(kind: str, softcap: float | None, with_sinks: bool) -> None:
    """Attention logit softcapping (Gemma 2) and per-head sinks (GPT-OSS) on every layout, grouped heads,
    float64, against the formula: output, and the gradients of q, k, v and the sinks (flex: forward only,
    its backward runs on CUDA: tests/models/test_packed_attention_cuda.py)."""
    torch.manual_seed(3)
    batch, heads, kv_heads, seq_len, dim = 2, 4, 2, DOCS.shape[1], 8
    q = torch.randn(batch, heads, seq_len, dim, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, seq_len, dim, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sinks = torch.randn(heads, dtype=torch.float64, requires_grad=True) if with_sinks else None
    docs = None if kind == "causal" else DOCS
    window = None if kind == "causal" else 4
    positions = None if docs is None else document_positions(docs)
    layout = attention_layout(batch, seq_len, positions, window, q.device, kind=kind)
    inputs = [t.detach().requires_grad_(kind != "flex") if t is not None else None for t in (q, k, v, sinks)]
    out = layout.attend(*inputs[:3], softcap=softcap, sinks=inputs[3])
    ref = naive_capped_sink_attention(q, k, v, naive_mask(docs, seq_len, window), softcap, sinks)
    errors = [relative_error(out, ref)]
    leaves = [t for t in (q, k, v, sinks) if t is not None]
    if kind != "flex":
        weight = torch.randn_like(ref)
        grads = torch.autograd.grad((out * weight).sum(), [t for t in inputs if t is not None])
        ref_grads = torch.autograd.grad((ref * weight).sum(), leaves)
        errors += [relative_error(g, r) for g, r in zip(grads, ref_grads)]
    print(f"{kind} softcap={softcap} sinks={with_sinks}: float64 rel err out/grads {[f'{e:.1e}' for e in errors]}")
    assert max(errors) < 1e-12
    plain = naive_capped_sink_attention(q, k, v, naive_mask(docs, seq_len, window), None, None)
    assert relative_error(plain, ref) > 1e-3  # the options change the output
