"""A model family as one unit: its config class (discriminated by `type:`; it also carries the blocks,
per-layer attention and sizing, see `fastlm.models.base.DecoderConfig`) and its Hugging Face adapter.
Each family package `fastlm/models/<name>/` exposes `FAMILY`; `fastlm.models.registry` lists them."""

from __future__ import annotations

from dataclasses import dataclass

from fastlm.models.base import DecoderConfig
from fastlm.models.hf_adapter import HFAdapter


@dataclass(frozen=True)
class Family:
    config: type[DecoderConfig]
    hf: HFAdapter

    @property
    def name(self) -> str:
        """The `type:` value of the family's model section."""
        return self.config.model_fields["type"].default
