"""The residual decoder block every family composes from its parts: pre-norm (x + attn(norm(x))),
sandwich-norm (x + post_norm(attn(norm(x))), Gemma) or post-norm only (x + post_norm(attn(x)), OLMo 2)
around attention and MLP, each branch optionally scaled before it joins the residual (Granite)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fastlm.layers.attention import Attention, Rotary
from fastlm.layers.kv_cache import LayerCache
from fastlm.layers.offload import ActivationOffload, OffloadedInput
from fastlm.layers.packed_attention import AttentionLayout
from fastlm.layers.tiled import run_tiled


class DecoderBlock(nn.Module):
    """x + post_attn_norm(attn(attn_norm(x))), then x + post_mlp_norm(mlp(mlp_norm(x))); the post norms are
    optional (None: plain pre-norm), and so are the pre norms (None: OLMo 2's post-norm only). Norms and the
    MLP are any modules with `reset_parameters`; the MLP is called as `mlp(x, real_tokens)` (fastlm/layers/mlp.py).
    `residual_scale` multiplies both branches before the residual sum (Granite's residual_multiplier).
    `layer_input_mixer` (fastlm/layers/layer_inputs.py): after the MLP, x + mixer(x, the layer's per-layer input)
    (Gemma 4's per-layer input embeddings)."""

    def __init__(self, attn_norm: nn.Module | None, attn: Attention, mlp_norm: nn.Module | None, mlp: nn.Module, dropout: float,
                 post_attn_norm: nn.Module | None = None, post_mlp_norm: nn.Module | None = None,
                 residual_scale: float = 1.0, layer_input_mixer: nn.Module | None = None) -> None:
        super().__init__()
        self.attn_norm = attn_norm
        self.attn = attn
        self.post_attn_norm = post_attn_norm
        self.mlp_norm = mlp_norm
        self.mlp = mlp
        self.post_mlp_norm = post_mlp_norm
        self.dropout = nn.Dropout(dropout)
        self.residual_scale = residual_scale
        self.layer_input_mixer = layer_input_mixer
        # Memory for time, set by DecoderLM.set_memory_savers: recompute the block in backward (keeping its input,
        # in host memory with `offload`), and run the norm + MLP over sequence tiles of `mlp_tile_len` (0: whole).
        self.activation_checkpointing = False
        self.offload: ActivationOffload | None = None
        self.mlp_tile_len = 0
        self.compiled_forward: Callable | None = None  # DecoderLM.compile_blocks: `_forward` compiled, for `offload`

    def forward(self, x: torch.Tensor, rotary: Rotary | None, layout: AttentionLayout | None,
                cache: LayerCache | None = None, real_tokens: torch.Tensor | None = None,
                layer_input: torch.Tensor | None = None,
                shared_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                experts: torch.Tensor | None = None) -> torch.Tensor:
        """With activation checkpointing (and grad on), only x is kept; backward recomputes the block (with the
        same `experts`). Generation passes a `cache` (and no layout). `real_tokens` (B, S), 1 real and 0 padding,
        reaches an MoE MLP (its router losses leave padding out); a dense MLP has nothing to count. `layer_input`
        (B, S, width): this layer's per-layer input, for the `layer_input_mixer`. `shared_kv`: an earlier layer's
        keys and values for an attention without its own (inputs of the recomputation too). `experts` (B, S, k):
        routing replay's recorded experts for an MoE MLP (called `mlp(x, real_tokens, experts)` only then, so dense
        MLPs keep their two arguments)."""
        if self.activation_checkpointing and torch.is_grad_enabled() and cache is None:
            if self.offload is not None:
                return self._offloaded_checkpoint(x, rotary, layout, real_tokens, layer_input, shared_kv, experts)
            return checkpoint(self._forward, x, rotary, layout, None, real_tokens, layer_input, shared_kv, experts,
                              use_reentrant=False)
        return self._forward(x, rotary, layout, cache, real_tokens, layer_input, shared_kv, experts)

    # torch.compiler.disable, applied at the first call (importing dynamo costs ~1 s): the input's trip to host
    # memory is eager, `compiled_forward` is the compiled part
    @torch._disable_dynamo
    def _offloaded_checkpoint(self, x: torch.Tensor, rotary: Rotary | None, layout: AttentionLayout | None,
                              real_tokens: torch.Tensor | None, layer_input: torch.Tensor | None,
                              shared_kv: tuple[torch.Tensor, torch.Tensor] | None,
                              experts: torch.Tensor | None) -> torch.Tensor:
        assert self.offload is not None
        return checkpoint(self._forward_offloaded, self.offload.store(x), rotary, layout, real_tokens, layer_input,
                          shared_kv, experts, use_reentrant=False)

    def _forward_offloaded(self, stored: OffloadedInput, rotary: Rotary | None, layout: AttentionLayout | None,
                           real_tokens: torch.Tensor | None, layer_input: torch.Tensor | None,
                           shared_kv: tuple[torch.Tensor, torch.Tensor] | None,
                           experts: torch.Tensor | None) -> torch.Tensor:
        forward = self.compiled_forward or self._forward
        return forward(stored.take(), rotary, layout, None, real_tokens, layer_input, shared_kv, experts)

    def _forward(self, x: torch.Tensor, rotary: Rotary | None, layout: AttentionLayout | None,
                 cache: LayerCache | None = None, real_tokens: torch.Tensor | None = None,
                 layer_input: torch.Tensor | None = None,
                 shared_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                 experts: torch.Tensor | None = None) -> torch.Tensor:
        shared = {} if shared_kv is None else {"shared_kv": shared_kv}  # only attention that shares takes it
        attended = self.attn(x if self.attn_norm is None else self.attn_norm(x), rotary, layout, cache, **shared)
        if self.post_attn_norm is not None:
            attended = self.post_attn_norm(attended)
        if self.residual_scale != 1.0:
            attended = attended * self.residual_scale
        x = x + self.dropout(attended)
        if self.mlp_tile_len and x.shape[1] > self.mlp_tile_len and torch.is_grad_enabled() and cache is None:
            mixed = run_tiled(self._feed_forward, x, self.mlp_tile_len, self._feed_forward_modules())
        else:
            mixed = self._feed_forward(x, real_tokens, experts)
        x = x + self.dropout(mixed)
        if self.layer_input_mixer is not None:
            assert layer_input is not None, "a block with a layer_input_mixer needs its layer_input"
            x = x + self.layer_input_mixer(x, layer_input)
        return x

    def _feed_forward(self, x: torch.Tensor, real_tokens: torch.Tensor | None = None,
                      experts: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP half without its residual: post_mlp_norm(mlp(mlp_norm(x))) * residual_scale, position by position."""
        normed = x if self.mlp_norm is None else self.mlp_norm(x)
        mixed = self.mlp(normed, real_tokens) if experts is None else self.mlp(normed, real_tokens, experts)
        if self.post_mlp_norm is not None:
            mixed = self.post_mlp_norm(mixed)
        return mixed * self.residual_scale if self.residual_scale != 1.0 else mixed

    def _feed_forward_modules(self) -> list[nn.Module]:
        return [m for m in (self.mlp_norm, self.mlp, self.post_mlp_norm) if m is not None]

    def reset_parameters(self, std: float, residual_std: float) -> None:
        """Norms to the identity, projections normal(0, std), residual outputs normal(0, residual_std)."""
        for norm in (self.attn_norm, self.post_attn_norm, self.mlp_norm, self.post_mlp_norm):
            if norm is not None:
                norm.reset_parameters()
        self.attn.reset_parameters(std, residual_std)
        self.mlp.reset_parameters(std, residual_std)
        if self.layer_input_mixer is not None:
            self.layer_input_mixer.reset_parameters(std, residual_std)
