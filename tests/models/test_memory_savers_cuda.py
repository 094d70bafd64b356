"""The memory savers on CUDA (the offload's side stream, pinned copies and prefetch exist only there): the same
loss and gradients as the plain path in fp32, eager and with compiled blocks, packed rows (FlexAttention)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (the offload's side stream and pinned host copies)", allow_module_level=True)

from model_helpers import load_preset, make_model
from test_packed_attention import max_grad_error, packed_rows, train_loss_and_grads

SAVERS = {"offload": {"checkpointing": True, "offload": True},
          "offload+tiled": {"checkpointing": True, "offload": True, "mlp_tile_len": 64},
          "tiled": {"checkpointing": False, "mlp_tile_len": 96}}


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("savers", list(SAVERS))
def test_memory_savers_on_cuda_keep_loss_and_gradients(savers: str, compiled: bool) -> None:
    torch._dynamo.reset()
    model = make_model(load_preset("tiny-llama"), dtype=torch.float32).cuda().train()
    tokens, documents = (t.cuda() for t in packed_rows(2, 512, model.config.vocab_size, seed=5))
    loss, grads = train_loss_and_grads(model, tokens, documents)
    if compiled:
        model.compile_blocks()
    model.set_memory_savers(**SAVERS[savers])
    for _ in range(2):  # the second step reuses the pinned buffers and the side stream's ordering
        saved_loss, saved_grads = train_loss_and_grads(model, tokens, documents)
    error = max_grad_error(saved_grads, grads)
    print(f"{savers} compiled={compiled}: loss {saved_loss:.8f} vs {loss:.8f}, max grad rel err {error:.2e}")
    assert saved_loss == pytest.approx(loss, rel=1e-5) and error < 1e-4
