"""Decoder behaviour: packed documents, sliding window, tied weights, training step, input errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from model_helpers import TINY_PRESETS, load_preset, make_model, relative_error, small_gpt2, small_llama

from fastlm.losses.spec import IGNORE_INDEX
from fastlm.models.build import count_parameters
from fastlm.models.decoder import build_model

CONFIGS = {
    "gpt2": small_gpt2(),
    "llama": small_llama(),
    "qwen2": small_llama(qkv_bias=True, tie_embeddings=True),
    "mistral": small_llama(sliding_window=5),
}


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_packed_documents_equal_documents_run_alone(kind: str) -> None:
    """No attention across documents, and positions restart: each piece of a packed row equals the
    same tokens run on their own."""
    model = make_model(CONFIGS[kind])
    torch.manual_seed(3)
    first, second = torch.randint(0, 50, (1, 7)), torch.randint(0, 50, (1, 9))
    packed = torch.cat([first, second], dim=1)
    document_ids = torch.tensor([[0] * 7 + [1] * 9])
    with torch.no_grad():
        hidden = model.hidden_states(packed, document_ids)
        errors = (
            relative_error(hidden[:, :7], model.hidden_states(first)),
            relative_error(hidden[:, 7:], model.hidden_states(second)),
        )
        unpacked = model.hidden_states(packed)
    print(f"{kind}: packed vs alone rel err doc1 {errors[0]:.2e}, doc2 {errors[1]:.2e}")
    assert max(errors) < 1e-12
    assert relative_error(unpacked[:, 7:], hidden[:, 7:]) > 1e-3  # without ids the documents do mix


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_float32_model_matches_float64_copy(kind: str) -> None:
    """The float32 model (the CPU training dtype) against the same weights in float64."""
    model64 = make_model(CONFIGS[kind])
    model32 = copy.deepcopy(model64).float()
    tokens = torch.randint(0, 50, (2, 12))
    document_ids = torch.tensor([[0] * 5 + [1] * 7, [2] * 12])
    weight = torch.randn(2, 12, 50, dtype=torch.float64)
    logits64, logits32 = model64.logits(tokens, document_ids), model32.logits(tokens, document_ids)
    (logits64 * weight).sum().backward()
    (logits32 * weight.float()).sum().backward()
    errors = [relative_error(logits32.double(), logits64)] + [
        relative_error(p32.grad.double(), p64.grad) for p32, p64 in zip(model32.parameters(), model64.parameters())
    ]
    print(f"{kind}: float32 vs float64 logits rel err {errors[0]:.2e}, worst grad rel err {max(errors[1:]):.2e}")
    assert max(errors) < 1e-4


def test_one_document_row_equals_no_document_ids() -> None:
    model = make_model(CONFIGS["llama"])
    tokens = torch.randint(0, 50, (2, 10))
    with torch.no_grad():
        error = relative_error(model.hidden_states(tokens, torch.full_like(tokens, 4)), model.hidden_states(tokens))
    assert error < 1e-12


def _influence(model: torch.nn.Module, tokens: torch.Tensor, query: int) -> list[bool]:
    """For every position up to `query`: does changing that token change the hidden state at `query`?
    Row p of one batch has token p perturbed; the last row is the unperturbed input."""
    rows = tokens.repeat(query + 2, 1)
    positions = torch.arange(query + 1)
    rows[positions, positions] = (rows[positions, positions] + 1) % 50
    with torch.no_grad():
        hidden = model.hidden_states(rows)[:, query]
    return [not torch.equal(hidden[p], hidden[-1]) for p in range(query + 1)]


@pytest.mark.parametrize("num_layers", [1, 2])
def test_sliding_window_limits_the_receptive_field(num_layers: int) -> None:
    """One layer: token t sees exactly t-w+1 .. t. Stacked layers reach back L*(w-1) tokens (as in
    Mistral), never further."""
    window = 4
    model = make_model(small_llama(num_layers=num_layers, sliding_window=window))
    tokens = torch.randint(0, 50, (1, 16))
    query = 14
    reach = num_layers * (window - 1)
    changed = _influence(model, tokens, query)
    assert changed == [position >= query - reach for position in range(query + 1)]


def test_tied_and_untied_embeddings() -> None:
    tied_config = small_llama(tie_embeddings=True)
    tied, untied = build_model(tied_config), build_model(small_llama(tie_embeddings=False))
    assert count_parameters(untied) - count_parameters(tied) == tied_config.vocab_size * tied_config.hidden_size
    assert tied.output_weight is tied.embeddings.tokens.weight
    assert untied.output_weight is not untied.embeddings.tokens.weight
    assert untied.output_weight.shape == (tied_config.vocab_size, tied_config.hidden_size)


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_tiny_preset_trains_one_step_on_cpu(name: str) -> None:
    """Forward + backward on packed rows with masked labels: finite loss, a gradient on every parameter."""
    config = load_preset(name)
    model = make_model(config, dtype=torch.float32).train()
    torch.manual_seed(4)
    tokens = torch.randint(0, config.vocab_size, (2, 48))
    document_ids = torch.tensor([[0] * 20 + [1] * 28, [0] * 48])
    labels = tokens.roll(-1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    labels[0, 19] = IGNORE_INDEX
    logits = model.logits(tokens, document_ids)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    loss.backward()
    assert torch.isfinite(loss) and 4.0 < loss.item() < 7.0  # about log(260) = 5.56 at init
    for parameter_name, parameter in model.named_parameters():
        assert parameter.grad is not None, f"{parameter_name} got no gradient"
        assert torch.isfinite(parameter.grad).all(), f"{parameter_name} has a non-finite gradient"
        assert parameter.grad.abs().max() > 0, f"{parameter_name} has an all-zero gradient"


def test_dropout_is_active_in_train_mode_only() -> None:
    model = make_model(small_gpt2(dropout=0.5))
    tokens = torch.randint(0, 50, (1, 12))
    with torch.no_grad():
        assert torch.equal(model.hidden_states(tokens), model.hidden_states(tokens))
        model.train()
        assert not torch.equal(model.hidden_states(tokens), model.hidden_states(tokens))


def test_bad_inputs_name_the_tensor() -> None:
    model = make_model(CONFIGS["gpt2"])
    tokens = torch.randint(0, 50, (2, 8))
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, seq_len\)"):
        model.hidden_states(tokens[0])
    with pytest.raises(ValueError, match="input_ids must be an integer tensor"):
        model.hidden_states(tokens.double())
    with pytest.raises(ValueError, match=r"input_ids has values in \[.*, 50\] but vocab_size is 50"):
        model.hidden_states(torch.full((1, 4), 50))
    with pytest.raises(ValueError, match="document_ids shape"):
        model.hidden_states(tokens, tokens[:, :4])
    with pytest.raises(ValueError, match="document_ids must be an integer tensor"):
        model.hidden_states(tokens, tokens.float())
    with pytest.raises(ValueError, match="max_seq_len=64"):
        model.hidden_states(torch.randint(0, 50, (1, 65)))
