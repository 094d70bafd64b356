"""The training path's attention layouts and compiled blocks at model level, on CPU in float64.

FlexAttention (the GPU path for packed rows) against the dense-mask reference for every architecture
(forward: FlexAttention has no CPU backward; its gradients are checked in test_packed_attention_cuda.py),
activation checkpointing and compiled blocks against the eager model (forward and gradients), the
compile fallback, and a whole-model torch.compile that treats the LM head as opaque.
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import TINY_PRESETS, load_preset, make_model, relative_error

from fastlm.engine.compile import CompileFallback, compile_wanted, describe_training_path
from fastlm.layers.embedding import document_positions
from fastlm.layers.packed_attention import document_mask_mod, flex_block_mask
from fastlm.losses.spec import LossNormalizers, LossTargets
from fastlm.models.decoder import DecoderLM


def packed_rows(batch: int, seq_len: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens and contiguous documents of random lengths 1..seq_len/2, ids unique per batch."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    documents = torch.empty(batch, seq_len, dtype=torch.long)
    next_id = 0
    for row in range(batch):
        start = 0
        while start < seq_len:
            length = int(torch.randint(1, seq_len // 2 + 1, (1,), generator=generator))
            documents[row, start : start + length] = next_id
            start, next_id = start + length, next_id + 1
    return tokens, documents


def train_loss_and_grads(model: DecoderLM, tokens: torch.Tensor, documents: torch.Tensor) -> tuple[float, list]:
    """One forward + backward of the LM loss on next-token labels (last label of each row masked)."""
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = -100
    model.zero_grad(set_to_none=True)
    result = model(tokens, LossTargets(labels=labels.reshape(-1)), LossNormalizers(tokens=float(labels.numel())), documents)
    result.loss.backward()
    return float(result.loss), [p.grad.clone() for p in model.parameters()]


def max_grad_error(grads: list, reference: list) -> float:
    return max(relative_error(g, r) for g, r in zip(grads, reference))


BLOCK_MASK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                     "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


@pytest.mark.parametrize("seq_len", [256, 320, 100])
@pytest.mark.parametrize(("documents", "window"), [(True, None), (True, 48), (True, 1), (False, 200), (False, 48)])
def test_block_mask_from_documents_equals_create_block_mask(seq_len: int, documents: bool, window: int | None) -> None:
    """The direct block mask (no pass over every pair) equals torch's create_block_mask of the same
    mask_mod, block for block: partial and full, kv and q orders, lengths not a multiple of the block."""
    from torch.nn.attention.flex_attention import create_block_mask

    _, ids = packed_rows(3, seq_len, 10, seed=seq_len + (window or 0))
    positions = document_positions(ids) if documents else None
    rows = 3 if documents else 1
    expected = create_block_mask(document_mask_mod(positions, window), rows, None, seq_len, seq_len, device="cpu")
    built = flex_block_mask(positions, window, 3, seq_len, torch.device("cpu"))
    assert built.seq_lengths == expected.seq_lengths
    for name in BLOCK_MASK_FIELDS:
        assert torch.equal(getattr(built, name), getattr(expected, name)), name


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_flex_layout_matches_dense_for_every_architecture(preset: str) -> None:
    """GPT-2 positions, RoPE + GQA, Qwen2 qkv bias, Mistral window: FlexAttention's block mask gives the
    dense mask's hidden states in float64, on packed rows with fresh random documents."""
    model = make_model(load_preset(preset), seed=3)
    tokens, documents = packed_rows(2, 40, model.config.vocab_size, seed=len(preset))
    with torch.no_grad():
        model.attention_kind = "dense"
        reference = model.hidden_states(tokens, documents)
        model.attention_kind = "flex"
        flex = model.hidden_states(tokens, documents)
    error = relative_error(flex, reference)
    print(f"{preset}: flex vs dense hidden states rel err {error:.2e}")
    assert error < 1e-12


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
def test_activation_checkpointing_keeps_loss_and_gradients(preset: str) -> None:
    model = make_model(load_preset(preset)).train()
    tokens, documents = packed_rows(2, 24, model.config.vocab_size, seed=7)
    loss, grads = train_loss_and_grads(model, tokens, documents)
    model.set_activation_checkpointing(True)
    checkpointed_loss, checkpointed_grads = train_loss_and_grads(model, tokens, documents)
    error = max_grad_error(checkpointed_grads, grads)
    print(f"{preset} activation checkpointing: loss {checkpointed_loss:.6f} vs {loss:.6f}, max grad rel err {error:.2e}")
    assert checkpointed_loss == pytest.approx(loss, rel=1e-13) and error < 1e-12


def test_compiled_blocks_match_eager_in_float64() -> None:
    """Blocks compiled (aot_eager: dynamo + AOTAutograd, no C++ build on CPU) train like the eager model,
    with activation checkpointing inside the compiled region too; the state dict keeps its keys."""
    torch._dynamo.reset()
    model = make_model(load_preset("mistral-tiny")).train()
    keys = list(model.state_dict())
    tokens, documents = packed_rows(2, 24, model.config.vocab_size, seed=11)
    loss, grads = train_loss_and_grads(model, tokens, documents)
    model.compile_blocks(backend="aot_eager")
    model.set_activation_checkpointing(True)
    compiled_loss, compiled_grads = train_loss_and_grads(model, tokens, documents)
    error = max_grad_error(compiled_grads, grads)
    print(f"compiled blocks: loss {compiled_loss:.6f} vs {loss:.6f}, max grad rel err {error:.2e}")
    assert model.blocks_compiled and list(model.state_dict()) == keys
    assert compiled_loss == pytest.approx(loss, rel=1e-12) and error < 1e-10


def test_whole_model_compile_breaks_once_at_the_head() -> None:
    """torch.compile(model) never traces the loss: one graph for the trunk, one break, at the opaque LM head."""
    torch._dynamo.reset()
    model = make_model(load_preset("tiny-llama"))
    tokens, documents = packed_rows(2, 16, model.config.vocab_size, seed=5)
    labels = torch.roll(tokens, -1, dims=1).reshape(-1)
    args = (tokens, LossTargets(labels=labels), LossNormalizers(tokens=float(labels.numel())), documents)
    explained = torch._dynamo.explain(model)(*args)
    reasons = [reason.reason for reason in explained.break_reasons]
    print(f"whole-model compile: {explained.graph_count} graph(s); breaks: {[r.splitlines()[0] for r in reasons]}")
    assert explained.graph_count == 1 and len(reasons) == 1 and "LMHead.forward" in reasons[0]


def _failing_backend(graph: torch.fx.GraphModule, example_inputs: list) -> None:
    raise RuntimeError("no compiler here\nsecond line")


def test_compile_failure_falls_back_to_eager_with_one_note(capsys: pytest.CaptureFixture) -> None:
    torch._dynamo.reset()
    model = make_model(load_preset("tiny-llama")).train()
    tokens, documents = packed_rows(2, 16, model.config.vocab_size, seed=9)
    loss, grads = train_loss_and_grads(model, tokens, documents)
    model.compile_blocks(backend=_failing_backend)
    fallback = CompileFallback(model)
    fallback_loss, fallback_grads = fallback.run(
        lambda: train_loss_and_grads(model, tokens, documents), lambda: model.zero_grad(set_to_none=True)
    )
    note = capsys.readouterr().err.strip()
    print(note)
    assert not model.blocks_compiled and note.count("\n") == 0 and "no compiler here" in note and "eagerly" in note
    assert fallback_loss == loss and max_grad_error(fallback_grads, grads) == 0.0


def test_compile_setting() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not compile_wanted("auto", cpu) and compile_wanted("auto", cuda)
    assert not compile_wanted("auto", cuda, "fsdp") and compile_wanted("auto", cuda, "ddp")
    assert compile_wanted(True, cpu) and not compile_wanted(False, cuda)
    line = describe_training_path("auto", False, cpu, 64)
    assert "eager blocks" in line and "dense mask" in line and "checkpointing off" in line
    line = describe_training_path("auto", True, cuda, 64)
    assert "blocks compiled" in line and "FlexAttention" in line and "checkpointing on" in line
    line = describe_training_path("auto", False, cuda, 8)
    assert "dense mask (head_dim 8 < 16, FlexAttention's minimum)" in line
