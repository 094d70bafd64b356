"""The decoder-only LM: embeddings -> blocks -> final norm -> LM head (docs/architecture.md).

One class serves every family: the config supplies the parts (`build_block`, `build_final_norm`, the
embedding's scale and learned positions) and each layer's attention (`layer_attention`: its window and
rotary embedding). A forward builds one attention layout / cache mask per distinct window and one cos/sin
per distinct rotary embedding, and hands each layer its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from fastlm.layers.embedding import Embeddings, document_positions
from fastlm.layers.kv_cache import KVCache
from fastlm.layers.moe import MoEMLP, add_router_losses
from fastlm.layers.offload import ActivationOffload
from fastlm.layers.packed_attention import LayoutKind, attention_layout
from fastlm.layers.rotary import rotary_angles
from fastlm.layers.vocab_parallel import gather_vocab, vocab_parallel_loss
from fastlm.losses.spec import LossNormalizers, LossResult, LossTargets, ProcessGroup
from fastlm.models.base import LayerAttention, Rope
from fastlm.models.config import ModelConfig

if TYPE_CHECKING:
    from fastlm.layers.lm_head import LMHead

Rotary = tuple[torch.Tensor, ...]  # cos, sin (+ the queries' scale per position: Rope.query_scale)


class DecoderLM(nn.Module):
    """Decoder-only language model with the loss head attached (`forward` returns a `LossResult`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        from fastlm.layers.lm_head import LMHead  # lazy: the head module imports the losses stack

        self.config = config
        self.embeddings = Embeddings(config.vocab_size, config.hidden_size, config.learned_positions, config.dropout,
                                     config.embedding_scale)
        self.blocks = nn.ModuleList(config.build_block(layer) for layer in range(config.num_layers))
        # The blocks' MoE layers, found once (a plain list: the state dict keeps its keys); empty in a dense model.
        self.moe_layers: list[MoEMLP] = [module for module in self.blocks.modules() if isinstance(module, MoEMLP)]
        # Each block's index into moe_layers (None: a dense block): where its slice of a routing replay is.
        moe_blocks = [next((m for m in block.modules() if isinstance(m, MoEMLP)), None) for block in self.blocks]
        self.block_moe: list[int | None] = [None if m is None else self.moe_layers.index(m) for m in moe_blocks]
        self.final_norm = config.build_final_norm()
        self.layer_inputs = config.build_layer_inputs()  # per-layer input embeddings (Gemma 4 E2B / E4B) or None
        # layers that attend over an earlier layer's keys and values (Gemma 4's shared KV), and those sources
        self.kv_sources: list[int] = [config.kv_source(layer) for layer in range(config.num_layers)]
        for source in {source for layer, source in enumerate(self.kv_sources) if source != layer}:
            self.blocks[source].attn.keeps_kv = True
        self.layer_attention: list[LayerAttention] = [config.layer_attention(i) for i in range(config.num_layers)]
        # The distinct windows and rotary embeddings, and each layer's index into them (plain lists: a compiled
        # decode step traces these loops without hashing config objects).
        self.windows: list[int | None] = list(dict.fromkeys(a.window for a in self.layer_attention))
        self.ropes: list[Rope | None] = list(dict.fromkeys(a.rope for a in self.layer_attention))
        self.layer_kinds: list[tuple[int, int]] = [
            (self.windows.index(a.window), self.ropes.index(a.rope)) for a in self.layer_attention]
        self.lm_head_weight = (
            None if config.tie_embeddings else nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        )
        self.head = LMHead(config.head)
        self.tp_group: ProcessGroup | None = None  # set by fastlm.layers.vocab_parallel.make_vocab_parallel
        # torch.compile'd views of the blocks (`compile_blocks`): a plain list, so the state dict keeps its keys.
        self._compiled_blocks: list[nn.Module] | None = None
        self.attention_kind: LayoutKind | None = None  # force a layout (tests, benchmarks); None: attention_layout picks
        self.activation_offload: ActivationOffload | None = None  # set_memory_savers
        self.init_weights()

    @property
    def output_weight(self) -> torch.Tensor:
        """(V, H) output projection: the token embedding when tied (this rank's V/tp rows when vocab-parallel)."""
        return self.embeddings.tokens.weight if self.lm_head_weight is None else self.lm_head_weight

    def init_weights(self) -> None:
        """normal(0, init_std); residual output projections std / sqrt(2 * num_layers); norms 1, biases 0.

        Call after `to_empty(device=...)` to materialise a model built on the meta device.
        """
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.num_layers)
        self.embeddings.reset_parameters(std)
        for block in self.blocks:
            block.reset_parameters(std, residual_std)
        self.final_norm.reset_parameters()
        if self.layer_inputs is not None:
            self.layer_inputs.reset_parameters(std)
        if self.lm_head_weight is not None:
            nn.init.normal_(self.lm_head_weight, mean=0.0, std=std)

    def reset_parameters(self) -> None:
        """Same as `init_weights` (the name torch's meta-device utilities look for)."""
        self.init_weights()

    def compile_blocks(self, backend: str | Callable = "inductor") -> None:
        """Compile each block for the training forward (torchtitan-style regions: the embedding, the mask
        build and the LM head stay eager, so dynamo never meets the loss kernels); parameters are shared."""
        self._compiled_blocks = [torch.compile(block, backend=backend) for block in self.blocks]
        for block in self.blocks:  # an offloaded checkpoint runs eagerly around the compiled block body
            block.compiled_forward = torch.compile(block._forward, backend=backend)

    def uncompile_blocks(self) -> None:
        self._compiled_blocks = None
        for block in self.blocks:
            block.compiled_forward = None

    @property
    def blocks_compiled(self) -> bool:
        return self._compiled_blocks is not None

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Keep only each block's input in the forward and recompute the block in backward (memory for time)."""
        self.set_memory_savers(checkpointing=enabled)

    def set_memory_savers(self, checkpointing: bool, offload: bool = False, mlp_tile_len: int = 0) -> None:
        """Memory for time in the training forward: recompute each block in backward (`checkpointing`), keep
        the recomputed blocks' inputs in pinned host memory (`offload`, fastlm/layers/offload.py), run each
        block's norm + MLP over sequence tiles (`mlp_tile_len` positions; 0: whole rows; fastlm/layers/tiled.py)."""
        device = next(self.parameters()).device
        self.activation_offload = ActivationOffload(device) if checkpointing and offload else None
        for block in self.blocks:
            block.activation_checkpointing = checkpointing
            block.offload = self.activation_offload
            block.mlp_tile_len = mlp_tile_len

    def hidden_states(self, input_ids: torch.Tensor, document_ids: torch.Tensor | None = None,
                      padding: torch.Tensor | None = None, routed_experts: torch.Tensor | None = None) -> torch.Tensor:
        """(B, S) token ids [+ (B, S) document ids of packed rows] [+ (B, S) bool `padding`, True where a row
        is padded: computed like any token, left out of the MoE router losses] [+ (B, S, M, k) `routed_experts`,
        each token's experts in each of the M MoE layers as the sampler chose them (routing replay), -1: the
        router's own choice] -> (B, S, H) after the final norm."""
        _check_inputs(input_ids, document_ids, self.config.vocab_size)
        batch, seq_len = input_ids.shape
        doc_positions = None if document_ids is None else document_positions(document_ids)
        positions = (
            torch.arange(seq_len, device=input_ids.device)[None] if doc_positions is None else doc_positions
        )
        dropout_active = self.training and self.config.dropout > 0
        layouts = [attention_layout(batch, seq_len, doc_positions, window, input_ids.device, dropout_active,
                                    self.attention_kind, head_dim=self.config.head_dim) for window in self.windows]
        rotaries = self._rotaries(positions)
        real_tokens = None if padding is None or not self.moe_layers else padding.logical_not().float()
        hidden = self.embeddings(input_ids, positions)
        layer_inputs = self._layer_inputs(input_ids, hidden)
        if self.activation_offload is not None:
            self.activation_offload.start()
        # Compiled blocks serve the training forward only: evaluation and sampling (no grad, other shapes) stay eager.
        training_forward = self._compiled_blocks is not None and torch.is_grad_enabled()
        blocks = self._compiled_blocks if training_forward else self.blocks
        kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for index, (block, (window, rope), moe) in enumerate(zip(blocks, self.layer_kinds, self.block_moe)):
            experts = None if routed_experts is None or moe is None else routed_experts[:, :, moe]
            hidden = block(hidden, rotaries[rope], layouts[window], real_tokens=real_tokens, experts=experts,
                           **self._block_extras(index, layer_inputs, kept))
        return self.final_norm(hidden)

    def _layer_inputs(self, input_ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor | None:
        """(B, S, layers, width) per-layer inputs (Gemma 4 E2B / E4B), or None."""
        return None if self.layer_inputs is None else self.layer_inputs(input_ids, embedded)

    def _block_extras(self, index: int, layer_inputs: torch.Tensor | None,
                      kept: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, object]:
        """Block `index`'s extra keyword arguments: its slice of the per-layer inputs, and the keys and values of
        its KV source (taken from a source layer's attention once it has run: `kept`, this forward's)."""
        extras: dict[str, object] = {}
        if layer_inputs is not None:
            extras["layer_input"] = layer_inputs[:, :, index]
        source = self.kv_sources[index]
        if source != index:
            if source not in kept:
                attention = self.blocks[source].attn
                kept[source], attention.kept_kv = attention.kept_kv, None
            extras["shared_kv"] = kept[source]
        return extras

    @property
    def rope_switch_positions(self) -> list[int]:
        """Positions whose arrival makes cached keys stale: longrope's original context, past which a row's keys
        take the long factors (the generator then recomputes the cache: `Generator._rebuild_step`)."""
        return sorted({rope.scaling.original_max_seq_len for rope in self.ropes
                       if rope is not None and rope.scaling is not None and rope.scaling.type == "longrope"
                       and rope.scaling.original_max_seq_len is not None})

    def _rotaries(self, positions: torch.Tensor, longest: torch.Tensor | None = None) -> list[Rotary | None]:
        """cos/sin per distinct rotary embedding of the layers (None: a layer without RoPE); `longest` (B, 1):
        each row's largest real position, where padding columns follow a row (longrope's choice)."""
        head_dim = self.config.head_dim
        assert head_dim is not None
        rotaries: list[Rotary | None] = []
        for rope in self.ropes:
            rotary = None if rope is None else rotary_angles(positions, rope.dims or head_dim, rope.theta, rope.scaling,
                                                             longest, rope.turning)
            if rope is not None and rope.query_scale is not None:
                beta, period = rope.query_scale
                rotary = (*rotary, 1 + beta * torch.log(1 + torch.floor(positions / period)))
            rotaries.append(rotary)
        return rotaries

    def cached_hidden_states(self, input_ids: torch.Tensor, cache: KVCache, columns: torch.Tensor, span: int,
                             last: torch.Tensor | None = None) -> torch.Tensor:
        """Generation: (B, S) tokens at cache `columns` (B, S) -> (B, S, H) after the final norm, their keys and
        values written into `cache`, attention over its first `span` columns (fastlm/layers/kv_cache.py).
        `last` (B,): each row's last real column when padding follows it (a right-padded prefill)."""
        positions = cache.positions(columns)
        masks = [cache.attention_mask(columns, span, window) for window in self.windows]
        rotaries = self._rotaries(positions, None if last is None else cache.positions(last[:, None]))
        hidden = self.embeddings(input_ids, positions)
        layer_inputs = self._layer_inputs(input_ids, hidden)
        kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for index, (block, (window, rope)) in enumerate(zip(self.blocks, self.layer_kinds)):
            layer_cache = cache.layer(self.kv_sources[index], columns, span, masks[window])
            hidden = block(hidden, rotaries[rope], None, layer_cache, **self._block_extras(index, layer_inputs, kept))
        return self.final_norm(hidden)

    def head_logits(self, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """Raw head output z (..., V) of hidden states (..., H), through `weight` (default: the output weight).

        Vocab-parallel: the shards are gathered to the full vocab (inference only, no gradient)."""
        logits = nn.functional.linear(hidden, self.output_weight if weight is None else weight)
        return logits if self.tp_group is None else gather_vocab(logits, self.tp_group)

    def logits(self, input_ids: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Raw head output z (B, S, V); `fastlm.losses.spec.transform_logits` gives what the softmax sees."""
        return self.head_logits(self.hidden_states(input_ids, document_ids))

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: LossTargets,
        normalizers: LossNormalizers,
        document_ids: torch.Tensor | None = None,
        head: LMHead | None = None,
        padding: torch.Tensor | None = None,
        routed_experts: torch.Tensor | None = None,
    ) -> LossResult:
        """Hidden states flattened to (B*S, H), then the LM head computes every configured loss: `head`, or
        the model's own (a trainer that trains other losses on the same weights passes its own head).
        `padding` (B, S) marks padded positions, left out of the router losses (`normalizers.positions`
        counts the step's other positions); `routed_experts` replays the sampler's routing (`hidden_states`)."""
        head = self.head if head is None else head
        hidden = self.hidden_states(input_ids, document_ids, padding, routed_experts).reshape(-1, self.config.hidden_size)
        if self.tp_group is not None:
            result = vocab_parallel_loss(head, hidden, self.output_weight, targets, normalizers, self.tp_group)
        else:
            result = head(hidden, self.output_weight, targets, normalizers)
        if self.training and self.moe_layers:  # the MoE layers' router losses join a training forward's loss
            result = add_router_losses(result, self.moe_layers, normalizers.positions)
        return result


def _check_inputs(input_ids: torch.Tensor, document_ids: torch.Tensor | None, vocab_size: int) -> None:
    """Clear errors for malformed inputs. The id range is checked on CPU only: on GPU it would cost a
    host sync every step, and an out-of-range id there already fails loudly (device-side assert); under
    torch.compile it would break the graph, and the CPU embedding raises on a bad id anyway."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    if input_ids.device.type == "cpu" and input_ids.numel() and not torch.compiler.is_compiling():
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= vocab_size:
            raise ValueError(f"input_ids has values in [{low}, {high}] but vocab_size is {vocab_size}")
    if document_ids is None:
        return
    if document_ids.shape != input_ids.shape:
        raise ValueError(
            f"document_ids shape {tuple(document_ids.shape)} must equal input_ids shape {tuple(input_ids.shape)}"
        )
    if document_ids.dtype.is_floating_point:
        raise ValueError(f"document_ids must be an integer tensor, got {document_ids.dtype}")


class _NoRandomFillOnMeta(torch.overrides.TorchFunctionMode):
    """Skips `normal_` on meta tensors (which hold no values): meta's `normal_` is a Python decomposition
    whose first call imports torch._dynamo, 1-4 s of every `fastlm validate`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.init.normal_ or func is torch.Tensor.normal_:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def build_model(config: ModelConfig, device: torch.device | str | None = None) -> DecoderLM:
    """Build on `device` (default: torch's current default). On "meta" nothing is allocated: count the
    parameters, or `model.to_empty(device=...)` then `model.init_weights()` to materialise."""
    if device is None:
        return DecoderLM(config)
    if torch.device(device).type == "meta":
        with torch.device(device), _NoRandomFillOnMeta():
            return DecoderLM(config)
    with torch.device(device):
        return DecoderLM(config)
