"""The CUDA training path against float64 references: FlexAttention kernels (forward and gradients),
every architecture in bf16 with packed rows, compiled blocks, and a whole-model torch.compile with the
fused Triton loss (the reported dynamo crash)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (FlexAttention kernels, bf16 autocast)", allow_module_level=True)

from model_helpers import TINY_PRESETS, load_preset, make_model, relative_error
from test_model_attention import naive_attention, naive_capped_sink_attention, naive_mask
from test_packed_attention import packed_rows

from fastlm.layers.embedding import document_positions
from fastlm.layers.packed_attention import attention_layout
from fastlm.losses.spec import LossNormalizers, LossTargets

CUDA = torch.device("cuda")


@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "window"),
    [(torch.float32, 8, 2, None), (torch.float32, 8, 2, 48), (torch.bfloat16, 8, 2, None),
     (torch.bfloat16, 8, 2, 48), (torch.bfloat16, 8, 8, None)],
)
def test_flex_kernels_match_float64_reference(heads: int, kv_heads: int, window: int | None, dtype: torch.dtype) -> None:
    """Compiled FlexAttention (document block mask, optional window, grouped kv heads in place) against
    the naive float64 formula on CPU: output and the three gradients."""
    torch.manual_seed(heads + kv_heads)
    batch, seq_len, dim = 2, 320, 64
    _, documents = packed_rows(batch, seq_len, 10, seed=heads * 7 + kv_heads)
    q = torch.randn(batch, heads, seq_len, dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq_len, dim, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq_len, dim, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(batch, heads, seq_len, dim, dtype=torch.float64)
    ref = naive_attention(q, k, v, naive_mask(documents, seq_len, window))
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))

    positions = document_positions(documents).to(CUDA)
    layout = attention_layout(batch, seq_len, positions, window, CUDA, head_dim=dim)
    assert layout.kind == "flex"
    inputs = [t.detach().to(CUDA, dtype).requires_grad_() for t in (q, k, v)]
    out = layout.attend(*inputs)
    grads = torch.autograd.grad((out * weight.to(CUDA, dtype)).sum(), inputs)
    errors = [relative_error(out.double().cpu(), ref)] + [relative_error(g.double().cpu(), r) for g, r in zip(grads, ref_grads)]
    print(f"flex {dtype} {heads}/{kv_heads} window={window}: rel err out/dq/dk/dv {[f'{e:.1e}' for e in errors]}")
    assert max(errors) < (2e-2 if dtype == torch.bfloat16 else 2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("softcap", "with_sinks", "window", "packed"),
                         [(50.0, False, 48, True), (None, True, 48, True), (20.0, True, None, True), (20.0, True, None, False)])
def test_flex_softcap_and_sinks_match_float64_reference(softcap: float | None, with_sinks: bool, window: int | None,
                                                        packed: bool, dtype: torch.dtype) -> None:
    """Compiled FlexAttention with the softcap score_mod (Gemma 2) and per-head sinks (GPT-OSS, through the
    returned log-sum-exp) against the float64 formula: output and the gradients of q, k, v and the sinks.
    Unpacked rows without a window (the causal layout: SDPA lacks both options) take FlexAttention too."""
    torch.manual_seed(5)
    batch, heads, kv_heads, seq_len, dim = 2, 8, 2, 320, 64
    _, documents = packed_rows(batch, seq_len, 10, seed=17)
    documents = documents if packed else None
    leaves = [torch.randn(batch, h, seq_len, dim, dtype=torch.float64, requires_grad=True)
              for h in (heads, kv_heads, kv_heads)]
    if with_sinks:
        leaves.append(torch.randn(heads, dtype=torch.float64, requires_grad=True))
    sinks = leaves[3] if with_sinks else None
    weight = torch.randn(batch, heads, seq_len, dim, dtype=torch.float64)
    ref = naive_capped_sink_attention(*leaves[:3], naive_mask(documents, seq_len, window), softcap, sinks)
    ref_grads = torch.autograd.grad((ref * weight).sum(), leaves)

    positions = None if documents is None else document_positions(documents).to(CUDA)
    layout = attention_layout(batch, seq_len, positions, window, CUDA)
    assert layout.kind == ("flex" if packed else "causal")
    inputs = [t.detach().to(CUDA, dtype if t.ndim > 1 else torch.float32).requires_grad_() for t in leaves]
    out = layout.attend(*inputs[:3], softcap=softcap, sinks=inputs[3] if with_sinks else None)
    grads = torch.autograd.grad((out * weight.to(CUDA, dtype)).sum(), inputs)
    errors = [relative_error(out.double().cpu(), ref)] + [relative_error(g.double().cpu(), r) for g, r in zip(grads, ref_grads)]
    print(f"flex {dtype} softcap={softcap} sinks={with_sinks} window={window} packed={packed}: rel err out/grads "
          f"{[f'{e:.1e}' for e in errors]}")
    assert max(errors) < (2e-2 if dtype == torch.bfloat16 else 2e-3)


def loss_and_grads(model, tokens, documents, amp: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = -100
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        result = model(tokens, LossTargets(labels=labels.reshape(-1)), LossNormalizers(tokens=float(labels.numel())), documents)
    result.loss.backward()
    return result.loss.detach().double().cpu(), [p.grad.double().cpu() for p in model.parameters()]


@pytest.mark.parametrize(("preset", "compiled"), [(p, False) for p in TINY_PRESETS] + [("mistral-tiny", True),
                                                    ("gemma2-tiny", False), ("gemma2-tiny", True)])
def test_every_architecture_trains_in_bf16_like_float64(preset: str, compiled: bool) -> None:
    """GPT-2, Llama (RoPE, GQA), Qwen2 (bias), Mistral (window) on packed rows: bf16 autocast with
    FlexAttention (eager, or blocks compiled by inductor) against the float64 dense-mask model on CPU."""
    torch._dynamo.reset()
    reference_model = make_model(load_preset(preset), seed=2).train()
    tokens, documents = packed_rows(2, 256, reference_model.config.vocab_size, seed=len(preset))
    ref_loss, ref_grads = loss_and_grads(reference_model, tokens, documents, amp=False)

    model = make_model(load_preset(preset), seed=2).float().to(CUDA).train()
    if compiled:
        model.compile_blocks()
    loss, grads = loss_and_grads(model, tokens.to(CUDA), documents.to(CUDA), amp=True)
    grad_error = max(relative_error(g, r) for g, r in zip(grads, ref_grads))
    print(f"{preset} compiled={compiled}: loss {float(loss):.5f} vs {float(ref_loss):.5f}, max grad rel err {grad_error:.1e}")
    assert abs(float(loss - ref_loss)) / float(ref_loss) < 1e-2 and grad_error < 5e-2


def test_whole_model_compile_with_the_triton_loss_runs() -> None:
    """`torch.compile(model)` with the fused Triton head: the head is opaque, so dynamo never traces the
    Triton launcher (the crash was in tracing; aot_eager keeps the test fast), and the loss and
    gradients equal the eager model's."""
    torch._dynamo.reset()
    config = load_preset("tiny-llama").model_copy(
        update={"head": load_preset("tiny-llama").head.model_copy(update={"use_triton": True})}
    )
    model = make_model(config, dtype=torch.float32).to(CUDA).train()
    tokens, documents = packed_rows(2, 128, config.vocab_size, seed=1)
    tokens, documents = tokens.to(CUDA), documents.to(CUDA)
    eager_loss, eager_grads = loss_and_grads(model, tokens, documents, amp=True)
    compiled_model = torch.compile(model, backend="aot_eager")
    loss, grads = loss_and_grads(compiled_model, tokens, documents, amp=True)
    assert model.head.implementation == "triton"
    error = max(relative_error(g, r) for g, r in zip(grads, eager_grads))
    print(f"torch.compile(model) + Triton loss: loss {float(loss):.5f} vs eager {float(eager_loss):.5f}, "
          f"grad rel err {error:.1e}")
    assert abs(float(loss - eager_loss)) < 1e-2 and error < 5e-2
