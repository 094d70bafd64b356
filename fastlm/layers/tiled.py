"""A function of the sequence run over tiles inside one autograd node (ALST's tiled MLP).

A block's feed-forward half (norm, gate/up projections, activation, down projection) works on each position
alone, so it can run over sequence tiles. Inside one autograd node the forward keeps only its input, and the
backward recomputes each tile and takes its gradients at once: the intermediates (at ffn_size wide, the
largest activations of a dense block: 3 GiB a layer at 128k tokens and a 6144-wide SwiGLU in bf16) exist
for one tile at a time, in the forward and in the backward. The parameters' gradients are summed over the
tiles and returned once, so DDP and FSDP see one gradient per parameter as with any other node.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn


def run_tiled(function: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile_len: int,
              modules: Sequence[nn.Module]) -> torch.Tensor:
    """`function(x)` for x (B, S, H) -> (B, S, H), computed over tiles of `tile_len` positions; `modules`
    hold every parameter `function` uses (their gradients come back through this node)."""
    params = [p for module in modules for p in module.parameters() if p.requires_grad]
    return _tiled(function, tile_len, params, x, *params)


# torch.compiler.disable, applied at the first call (importing dynamo costs ~1 s): its backward calls autograd
# itself, so a compiled block breaks its graph here instead
@torch._disable_dynamo
def _tiled(function: Callable, tile_len: int, params: list[torch.Tensor], x: torch.Tensor,
           *inputs: torch.Tensor) -> torch.Tensor:
    return _TiledFunction.apply(function, tile_len, params, x, *inputs)


class _TiledFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, function: Callable, tile_len: int, params: list[torch.Tensor], x: torch.Tensor,  # type: ignore[override]
                *inputs: torch.Tensor) -> torch.Tensor:
        ctx.function, ctx.tile_len, ctx.params = function, tile_len, params
        ctx.autocast = _autocast_state(x.device.type)
        ctx.save_for_backward(x)
        out = torch.empty_like(x)
        with torch.no_grad():
            for start in range(0, x.shape[1], tile_len):
                out[:, start:start + tile_len] = function(x[:, start:start + tile_len])
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        params: list[torch.Tensor] = ctx.params
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[3] else None
        grad_params: list[torch.Tensor | None] = [None] * len(params)
        device_type, enabled, dtype = ctx.autocast
        for start in range(0, x.shape[1], ctx.tile_len):
            tile = x[:, start:start + ctx.tile_len].detach().requires_grad_(grad_x is not None)
            with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
                out = ctx.function(tile)
            wanted = ([tile] if grad_x is not None else []) + params
            grads = torch.autograd.grad(out, wanted, grad_out[:, start:start + ctx.tile_len], allow_unused=True)
            if grad_x is not None:
                grad_x[:, start:start + ctx.tile_len] = grads[0]
                grads = grads[1:]
            for index, grad in enumerate(grads):
                if grad is not None:
                    if grad_params[index] is None:
                        grad_params[index] = grad.clone()  # owned: the later tiles add into it
                    else:
                        grad_params[index].add_(grad)
        return (None, None, None, grad_x, *grad_params)


def _autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    """The forward's autocast, which the backward's recomputation must repeat (as torch's checkpoint does)."""
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
