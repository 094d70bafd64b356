"""The `rl.backend:` section: which generation backend samples the rollouts, a union on `type`, built by `build()`.

`native` (the default) is fastlm's own KV-cache sampler on the trainer's model (backend.py) and owns its
knobs; `transformers` samples with transformers' `generate` on a Hugging Face-layout replica of the policy
(hf_backend.py): the parity reference for the native sampler and the template of a server backend
(docs/rl.md). A backend whose Python package is missing is refused at the start (`missing_packages`,
reported by `fastlm/rl/checks.py`), not at the first rollout.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import Field

from fastlm.config.base import ConfigModel

if TYPE_CHECKING:
    import torch

    from fastlm.generation.backend import NativeBackend
    from fastlm.generation.generator import TokenizerLike
    from fastlm.generation.hf_backend import TransformersBackend
    from fastlm.models.decoder import DecoderLM

# The native backend's knobs, once top-level `rl.` keys: a config that still sets one is told where it moved.
MOVED_TO_BACKEND = ("generation", "decode_slots", "kv_cache_memory_gib", "cuda_graph", "compile_decode")


class NativeBackendConfig(ConfigModel):
    """fastlm's sampler on the trainer's own model: the rollout engine or the static batch (docs/rl.md)."""

    type: Literal["native"] = "native"
    requires: ClassVar[tuple[str, ...]] = ()  # Python packages the backend imports
    generation: Literal["engine", "static"] = Field(
        "engine", description="'engine' (continuous batching over decode_slots slots, a paged KV cache, a prompt's "
        "prefill shared by its group; families it cannot serve fall back to 'static') or 'static' (one static "
        "batch, a cache of rows x longest). Both draw the same tokens for the same seeds.")
    decode_slots: int = Field(256, ge=1, description="engine: sequences decoded at once.")
    kv_cache_memory_gib: float | None = Field(
        None, gt=0.0, allow_inf_nan=False, description="engine: the paged KV cache's size; None: 30% of the free "
        "device memory at the first rollout (on CPU: each request's worst case). Sequences wait when it is full.")
    cuda_graph: bool = Field(True, description="Capture the decode step in a CUDA graph (CUDA only).")
    compile_decode: bool = Field(False, description="torch.compile the decode step before capturing it (CUDA).")

    def build(self, model: DecoderLM, tokenizer: TokenizerLike, amp_dtype: torch.dtype | None, multi_turn: bool,
              record_routing: bool = False) -> NativeBackend:
        """Kept across rollouts (its CUDA graphs too): graphs where they run (CUDA, no vocab-parallel head);
        static multi-turn episodes keep each row at its own cache columns; `record_routing` (rl.routing_replay)
        returns each token's experts with its completion."""
        from fastlm.generation.backend import NativeBackend

        graphs = self.cuda_graph and model.output_weight.device.type == "cuda" and model.tp_group is None
        return NativeBackend(model, tokenizer, amp_dtype, cuda_graph=graphs, compile=self.compile_decode and graphs,
                             padding="right" if multi_turn else "left", engine=self.generation == "engine",
                             max_slots=self.decode_slots, kv_cache_memory_gib=self.kv_cache_memory_gib,
                             record_routing=record_routing)


class TransformersBackendConfig(ConfigModel):
    """transformers' `generate` on a Hugging Face-layout replica of the policy (the family's HF export, built in
    memory; `sync_weights` copies the trainer's weights in): parity tests and the template of a server backend.
    Single-turn only."""

    type: Literal["transformers"] = "transformers"
    requires: ClassVar[tuple[str, ...]] = ("transformers",)

    def build(self, model: DecoderLM, tokenizer: TokenizerLike, amp_dtype: torch.dtype | None, multi_turn: bool,
              record_routing: bool = False) -> TransformersBackend:
        """`multi_turn` and `record_routing` are refused by the config's checks (RLConfig) before this runs."""
        from fastlm.generation.hf_backend import TransformersBackend

        assert not multi_turn and not record_routing, "RLConfig refuses these for the transformers backend"
        return TransformersBackend(model, tokenizer, amp_dtype)


BackendConfig = Annotated[NativeBackendConfig | TransformersBackendConfig, Field(discriminator="type")]


def default_backend_type(data: Any) -> Any:
    """`backend: {generation: static}` without `type:` means the native backend."""
    if isinstance(data, dict) and "type" not in data:
        return {"type": "native", **data}
    return data


def missing_packages(config: NativeBackendConfig | TransformersBackendConfig) -> list[str]:
    """The Python packages `config`'s backend imports that are not installed (none: it can be built)."""
    return [name for name in config.requires if importlib.util.find_spec(name) is None]
