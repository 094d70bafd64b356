"""Long-sequence memory savers against the plain path, float64 on CPU with packed documents: the tiled MLP
(fastlm/layers/tiled.py) and offloaded checkpoints (fastlm/layers/offload.py) give the same loss and the
same gradients, and each parameter's gradient arrives once per backward (as DDP and FSDP expect)."""

from __future__ import annotations

import pytest
import torch
from model_helpers import load_preset, make_model
from test_packed_attention import max_grad_error, packed_rows, train_loss_and_grads

from fastlm.config.errors import ConfigError
from fastlm.layers.offload import ActivationOffload
from fastlm.layers.tiled import run_tiled
from fastlm.run_config.loader import load_config

SAVERS = {
    "tiled": {"checkpointing": False, "mlp_tile_len": 5},
    "tiled+checkpointing": {"checkpointing": True, "mlp_tile_len": 7},
    "offload": {"checkpointing": True, "offload": True},
    "offload+tiled": {"checkpointing": True, "offload": True, "mlp_tile_len": 4},
}


@pytest.mark.parametrize("preset", ["tiny-llama", "gemma3-tiny"])
@pytest.mark.parametrize("savers", list(SAVERS))
def test_memory_savers_keep_loss_and_gradients(preset: str, savers: str) -> None:
    model = make_model(load_preset(preset)).train()
    tokens, documents = packed_rows(2, 24, model.config.vocab_size, seed=3)
    loss, grads = train_loss_and_grads(model, tokens, documents)
    model.set_memory_savers(**SAVERS[savers])
    saved_loss, saved_grads = train_loss_and_grads(model, tokens, documents)
    error = max_grad_error(saved_grads, grads)
    print(f"{preset} {savers}: loss {saved_loss:.12f} vs {loss:.12f}, max grad rel err {error:.2e}")
    assert saved_loss == pytest.approx(loss, rel=1e-13) and error < 1e-12


def test_tiled_function_gives_each_gradient_once() -> None:
    """A tiled norm + MLP returns its input's and parameters' gradients as one node: each parameter's
    gradient is accumulated once whatever the tile count, and equals the untiled gradient."""
    torch.manual_seed(0)
    model = make_model(load_preset("tiny-llama")).train()
    block = model.blocks[0]
    x = torch.randn(2, 23, model.config.hidden_size, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, 23, model.config.hidden_size, dtype=torch.float64)
    (block._feed_forward(x) * weight).sum().backward()
    reference = [x.grad.clone()] + [p.grad.clone() for p in block.mlp.parameters()]
    x.grad = None
    block.zero_grad(set_to_none=True)
    arrivals = {id(p): 0 for p in block.parameters()}
    for parameter in block.parameters():
        parameter.register_post_accumulate_grad_hook(lambda p: arrivals.__setitem__(id(p), arrivals[id(p)] + 1))
    out = run_tiled(block._feed_forward, x, 4, block._feed_forward_modules())
    (out * weight).sum().backward()
    tiled = [x.grad] + [p.grad for p in block.mlp.parameters()]
    error = max_grad_error(tiled, reference)
    used = [id(p) for m in block._feed_forward_modules() for p in m.parameters()]
    print(f"tiled (6 tiles) vs whole: grad rel err {error:.2e}; arrivals {sorted(arrivals[i] for i in used)}")
    assert error < 1e-13 and all(arrivals[i] == 1 for i in used)


def test_offload_brings_every_input_back_once() -> None:
    """Each checkpointed block's input is stored in the forward and taken back in the backward, the one before
    it fetched ahead; nothing is left held after the step."""
    model = make_model(load_preset("tiny-llama")).train()
    model.set_memory_savers(checkpointing=True, offload=True)
    offload = model.activation_offload
    assert isinstance(offload, ActivationOffload)
    tokens, documents = packed_rows(2, 16, model.config.vocab_size, seed=1)
    stored = []
    original = offload.store
    offload.store = lambda x: stored.append(original(x)) or stored[-1]  # type: ignore[method-assign]
    train_loss_and_grads(model, tokens, documents)
    assert len(stored) == model.config.num_layers
    assert [s.previous for s in stored] == [None, *stored[:-1]]
    assert all(s.gpu is None and s.loaded is None and s.host is None for s in stored)


@pytest.mark.parametrize(("override", "message"), [
    ("model.dropout=0.1", "dropout"),
    ("model={type: qwen3_moe, vocab_size: 256, hidden_size: 32, num_layers: 2, num_heads: 4, num_kv_heads: 2, "
     "head_dim: 8, intermediate_size: 64, moe: {num_experts: 4, top_k: 2, ffn_size: 32}}", "MoE"),
])
def test_tiled_mlp_refuses_what_its_recomputation_would_change(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config("configs/tiny.yaml", ["trainer.mlp_tile_len=64", override])
    issues = [issue for issue in raised.value.issues if issue.path == "trainer.mlp_tile_len"]
    print([issue.message for issue in issues])
    assert len(issues) == 1 and message in issues[0].message


def test_offload_needs_checkpointing() -> None:
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        load_config("configs/tiny.yaml", ["trainer.activation_offload=true"])


def test_compiled_blocks_with_offload_and_tiles_match_eager() -> None:
    """Compiled blocks (aot_eager on CPU): the offloaded checkpoint runs eagerly around the compiled block body,
    and the tiled MLP breaks the block's graph; both train like the eager model."""
    torch._dynamo.reset()
    model = make_model(load_preset("mistral-tiny")).train()
    tokens, documents = packed_rows(2, 24, model.config.vocab_size, seed=11)
    loss, grads = train_loss_and_grads(model, tokens, documents)
    model.compile_blocks(backend="aot_eager")
    model.set_memory_savers(checkpointing=True, offload=True, mlp_tile_len=8)
    compiled_loss, compiled_grads = train_loss_and_grads(model, tokens, documents)
    error = max_grad_error(compiled_grads, grads)
    print(f"compiled + offload + tiles: loss {compiled_loss:.12f} vs {loss:.12f}, max grad rel err {error:.2e}")
    assert compiled_loss == pytest.approx(loss, rel=1e-12) and error < 1e-10
