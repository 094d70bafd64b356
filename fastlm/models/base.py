"""What every model family's config shares, and the interface a family fills in (docs/architecture.md,
"Model families"): its blocks, its per-layer attention, its sizing. The generic decoder, sizing, HF
interop and generator call only these methods, so nothing outside a family branches on its type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field, model_validator

from fastlm.config.base import ConfigModel
from fastlm.config.errors import ConfigIssue
from fastlm.layers.rope_scaling import RopeScaling
from fastlm.losses.config import LMHeadConfig
from fastlm.models.lora_config import LoraConfig

if TYPE_CHECKING:
    from torch import nn

    from fastlm.layers.kv_cache import RecurrentShape


def rotary_width(head_dim: int | None, partial_rotary_factor: float) -> int:
    """RoPE's width in each head of a partial-rotary family (GLM-4, Phi-4-mini, Qwen3.5): the first
    `partial_rotary_factor` of head_dim, which must be a positive even number (ValueError otherwise)."""
    dims = int((head_dim or 0) * partial_rotary_factor)
    if dims < 2 or dims % 2:
        raise ValueError(f"partial_rotary_factor {partial_rotary_factor} x head_dim {head_dim} = {dims} rotary dims; "
                         "it must be a positive even number")
    return dims


@dataclass(frozen=True)
class Rope:
    """A layer's rotary embedding: base `theta`, optional frequency `scaling`, the rotated `dims` of each head
    (None: all; fewer: partial rotary), `query_scale` (beta, period): the rotated queries times
    1 + beta * log(1 + floor(position / period)) (Llama 4's and Ministral 3's attention temperature), and
    `turning`: only the first `turning` of the dims / 2 frequencies turn, the others are 0 (their pairs pass
    unchanged; Gemma 4's proportional RoPE, whose frequencies stay those of the whole width)
    (hashable: layers sharing it share one cos/sin per forward)."""

    theta: float
    scaling: RopeScaling | None = None
    dims: int | None = None
    query_scale: tuple[float, int] | None = None
    turning: int | None = None


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends: a sliding `window` (None: global) and its `rope` (None: no rotary, e.g. learned
    positions). The decoder builds one mask per distinct window and one cos/sin per distinct rope."""

    window: int | None
    rope: Rope | None


class DecoderConfig(ConfigModel):
    """What every decoder shares. A family subclasses it with a `type: Literal[...]` discriminator and
    overrides the family interface below."""

    vocab_size: int = Field(260, ge=2, description="Must cover the tokenizer (byte tokenizer: 260).")
    hidden_size: int = Field(128, ge=1)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    head_dim: int | None = Field(None, ge=1, description="Defaults to hidden_size / num_heads.")
    max_seq_len: int = Field(256, ge=1)
    tie_embeddings: bool = True
    init_std: float = Field(0.02, gt=0.0)
    norm_eps: float = Field(1e-5, gt=0.0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    head: LMHeadConfig = Field(default_factory=LMHeadConfig)
    lora: LoraConfig | None = Field(None, description="Train low-rank adapters on a frozen base (fastlm/lora).")

    # Fields that do not change the weights' shapes or the forward's math (a checkpoint need not match them).
    NOT_ARCHITECTURE: ClassVar[frozenset[str]] = frozenset({"head", "init_std", "dropout", "max_seq_len", "lora"})

    @model_validator(mode="before")
    @classmethod
    def _default_head_dim(cls, data: Any) -> Any:
        """head_dim is explicit after validation (hidden_size / num_heads unless the config decouples it)."""
        if isinstance(data, dict) and data.get("head_dim") is None:
            hidden = data.get("hidden_size", cls.model_fields["hidden_size"].default)
            heads = data.get("num_heads", cls.model_fields["num_heads"].default)
            if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
                if hidden % heads:
                    raise ValueError(f"hidden_size {hidden} is not divisible by num_heads {heads}; "
                                     "pick num_heads that divides hidden_size, or set head_dim")
                data = {**data, "head_dim": hidden // heads}
        return data

    @model_validator(mode="after")
    def _head_follows_the_architecture(self) -> DecoderConfig:
        """`head.logit_scale` / `head.softcap` default to the architecture's own (`head_transform`: Gemma 2's
        final softcap, Granite's logits scaling); a head that sets other values trains them, and the HF export,
        whose architecture applies its own, refuses it."""
        values = dict(zip(("logit_scale", "softcap"), self.head_transform()))
        unset = {name: value for name, value in values.items()
                 if name not in self.head.model_fields_set and value != getattr(self.head, name)}
        if unset:
            self.__dict__["head"] = self.head.model_copy(update=unset)  # no re-validation: the values are the model's
        return self

    # --- the family interface ---------------------------------------------------------------------
    def head_transform(self) -> tuple[float, float | None]:
        """(logit_scale, softcap) the architecture itself applies to its logits, which `head` takes over
        (Gemma 2's final logit softcap, Granite's 1 / logits_scaling); (1.0, None): none."""
        return 1.0, None

    @property
    def kv_heads(self) -> int:
        """Key/value heads (grouped-query attention); all heads by default."""
        return self.num_heads

    @property
    def ffn_size(self) -> int:
        raise NotImplementedError

    def layer_kv_shape(self, layer: int) -> tuple[int, int]:
        """(kv heads, head width) of layer `layer`'s keys and values: the model's (`kv_cache_shape`) unless the
        layers differ (Gemma 4's global layers: wider heads, fewer kv heads)."""
        kv_heads, key_width, _ = self.kv_cache_shape()
        return kv_heads, key_width

    def kv_cache_shape(self) -> tuple[int, int, int | None]:
        """The generation cache per token and layer: (kv heads, key width, value width when the values are the
        first columns of the keys (a latent cache: multi-head latent attention), else None: values as keys)."""
        return self.kv_heads, self.head_dim or 0, None

    @property
    def embedding_scale(self) -> float:
        """Factor on the token embedding (Gemma: sqrt(hidden_size))."""
        return 1.0

    @property
    def learned_positions(self) -> int | None:
        """Rows of a learned position embedding (GPT-2: max_seq_len); None without one."""
        return None

    def layer_attention(self, layer: int) -> LayerAttention:
        """Layer `layer`'s window and rotary embedding."""
        raise NotImplementedError

    def build_block(self, layer: int) -> nn.Module:
        """Layer `layer` as a `fastlm.layers.block.DecoderBlock` (or any module with its forward and
        `reset_parameters(std, residual_std)`); imports torch lazily."""
        raise NotImplementedError

    def build_final_norm(self) -> nn.Module:
        raise NotImplementedError

    def build_layer_inputs(self) -> nn.Module | None:
        """The per-layer input embeddings (`fastlm.layers.layer_inputs.PerLayerInputs`: Gemma 4 E2B / E4B), whose
        (B, S, layers, width) output hands each block its slice; None (the default): no such inputs."""
        return None

    def kv_source(self, layer: int) -> int:
        """The layer whose keys and values layer `layer` attends over: itself by default; an earlier one where
        layers share KV (Gemma 4's num_kv_shared_layers: no key/value projections of their own, and in
        generation they read that layer's cache)."""
        return layer

    def device_issues(self, on_gpu: bool) -> list[ConfigIssue]:
        """What this machine lacks for the model's chosen kernels (`fastlm.engine.preflight`); none by default."""
        return []

    def recurrent_state(self, layer: int) -> RecurrentShape | None:
        """What layer `layer` caches in generation instead of keys and values (a linear-attention layer's
        state, fastlm/layers/kv_cache.py); None: an attention layer (the default)."""
        return None

    def block_parameters(self, layer: int) -> int:
        """Parameters of block `layer`, written out from the architecture (independent of the module code)."""
        raise NotImplementedError

    def blocks_parameters(self) -> int:
        """All blocks; a family whose layers differ in size overrides this (a hostile config.json may
        claim 10^15 layers, so the default multiplies instead of summing layer by layer)."""
        return self.num_layers * self.block_parameters(0)

    def active_blocks_parameters(self) -> int:
        """Block parameters one token's forward multiplies by (FLOPs); a mixture-of-experts family counts
        only the experts a token is routed to."""
        return self.blocks_parameters()

    def final_norm_parameters(self) -> int:
        raise NotImplementedError

    def embedding_parameters(self) -> int:
        """Token (+ learned position) embeddings and the untied output matrix, if any."""
        tokens = self.vocab_size * self.hidden_size
        positions = (self.learned_positions or 0) * self.hidden_size
        return tokens + positions + (0 if self.tie_embeddings else tokens)

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs of the QK^T and AV products per token: 12 * (q heads * head_dim) * span per layer
        (2 * 2 * span * width forward, x3 with the backward), span = min(seq_len, the layer's window); like
        PaLM the causal halving is not applied, and packed documents are not taken into account."""
        width = self.num_heads * (self.head_dim or 0)
        total = 0.0
        for layer in range(self.num_layers):
            window = self.layer_attention(layer).window
            total += 12.0 * width * (min(seq_len, window) if window else seq_len)
        return total

    def architecture(self) -> dict[str, Any]:
        """What decides the weights' shapes and the forward's math, resolved (defaults filled in): a run's
        model section must equal its `run.init_path` checkpoint's on these."""
        values = self.model_dump(mode="json", exclude=set(self.NOT_ARCHITECTURE))
        values["intermediate_size"] = self.ffn_size
        return values
