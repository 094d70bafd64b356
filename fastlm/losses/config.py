"""Loss children (discriminated by `type:`) and the monolithic loss they compose into.

The math lives in docs/design/losses.md; this module only says what a user may configure and
rejects combinations that no implementation can run.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, model_validator

from fastlm.config.base import ConfigModel
from fastlm.losses.children import CHILD_CLASSES, CHILD_CONFIGS, ChildConfig, CrossEntropyConfig
from fastlm.losses.frozen_model import FrozenModel


class DPOConfig(ChildConfig):
    type: Literal["dpo"] = "dpo"
    beta: float = Field(0.1, gt=0.0)
    reference_path: str | None = Field(
        None, description="Checkpoint directory of the frozen reference; None means a copy of the initial policy."
    )

    def frozen_model(self) -> FrozenModel:
        return FrozenModel("reference", "reference_path", self.reference_path)


# The shared-softmax children come from the registry (fastlm/losses/children); DPO works on summed
# sequence log-probs, outside the shared softmax.
MonolithicChild = Annotated[Union[CHILD_CONFIGS], Field(discriminator="type")]  # type: ignore[valid-type]  # noqa: UP007 - a tuple of classes
LossChild = Annotated[Union[(*CHILD_CONFIGS, DPOConfig)], Field(discriminator="type")]  # type: ignore[valid-type]

# The chunked head's default logits budget: 4096-token chunks at V=131072 in bf16 (with a teacher, its logits
# 1536 tokens at a time beside them: 1.375 GiB; extra memory under the 1.5 GiB goal), a single chunk for small
# heads (docs/losses.md, "The head without full logits", says why).
DEFAULT_LOGITS_MEMORY_MIB = 1408.0

CHILD_TYPES: frozenset[str] = frozenset({*(child.kind for child in CHILD_CLASSES), "dpo"})
# Children the Triton path runs: every shared-softmax child (fused where it has a slot, else its torch tail
# between two launches).
TRITON_CHILD_TYPES: frozenset[str] = frozenset(child.kind for child in CHILD_CLASSES)


class MonolithicLossConfig(ConfigModel):
    """The children that share one softmax, plus the numeric options of the head."""

    children: dict[str, MonolithicChild]
    use_triton: bool | None = None
    logit_scale: float = 1.0
    softcap: float | None = None
    chunk_tokens: int = 4096


class LMHeadConfig(ConfigModel):
    """The LM head: output projection options and the losses computed on its logits."""

    losses: dict[str, LossChild] = Field(default_factory=lambda: {"cross_entropy": CrossEntropyConfig()})
    use_triton: bool | None = Field(
        None, description="true: require the fused kernel; null: Triton on CUDA when supported; false: compiled."
    )
    logit_scale: float = Field(1.0, gt=0.0, description="Logits are multiplied by this before the softmax.")
    softcap: float | None = Field(None, gt=0.0, description="x = softcap * tanh(x / softcap) when set.")
    chunk_tokens: int = Field(4096, ge=1, description="Tokens per chunk in the compiled path (bounds peak memory).")
    logits_memory_mib: float | None = Field(
        DEFAULT_LOGITS_MEMORY_MIB, ge=0.0,
        description="The head without full logits: MiB for its (chunk, vocab) logits buffer (and the teacher's with "
        f"distillation), which sets the tokens per chunk; 0 = full logits; null = {DEFAULT_LOGITS_MEMORY_MIB:g}.",
    )

    @model_validator(mode="before")
    @classmethod
    def _type_from_name(cls, data: Any) -> Any:
        """`losses: {cross_entropy: {}}` needs no `type:` when the name is a type."""
        if isinstance(data, dict) and isinstance(data.get("losses"), dict):
            losses = {
                name: {"type": name, **child} if isinstance(child, dict) and "type" not in child and name in CHILD_TYPES
                else child
                for name, child in data["losses"].items()
            }
            data = {**data, "losses": losses}
        return data

    @model_validator(mode="after")
    def _check_children(self) -> LMHeadConfig:
        if not self.losses:
            raise ValueError("at least one loss is needed; e.g. losses: {cross_entropy: {type: cross_entropy}}")
        kinds: dict[str, str] = {}
        for name, child in self.losses.items():
            if child.type in kinds:
                raise ValueError(
                    f"losses '{kinds[child.type]}' and '{name}' are both of type '{child.type}'; "
                    "keep one child of each type"
                )
            kinds[child.type] = name
        if "dpo" in kinds and len(kinds) > 1:
            others = sorted(n for n, c in self.losses.items() if c.type != "dpo")
            raise ValueError(
                f"dpo works on summed sequence log-probs and cannot share the softmax with {others}; "
                "use dpo alone in losses"
            )
        if self.use_triton is True:
            unsupported = sorted(f"{n} ({c.type})" for n, c in self.losses.items() if c.type not in TRITON_CHILD_TYPES)
            if unsupported:
                raise ValueError(
                    f"use_triton: true, but the fused Triton kernel has no path for {unsupported}; "
                    f"it supports {sorted(TRITON_CHILD_TYPES)}. Set use_triton: null or false"
                )
            options = sorted(n for n, c in self.losses.items() if not c.triton_supported)
            if options:
                raise ValueError(
                    f"use_triton: true, but the fused Triton kernel has no path for the options of {options} "
                    "(distillation top_k: the teacher's top-k support runs compiled only); "
                    "set use_triton: null or false (the compiled path runs it)"
                )
        return self

    def child_of_type(self, kind: str) -> tuple[str, ChildConfig] | None:
        """The (name, config) of the child of this type, if present (validation allows one per type)."""
        for name, child in self.losses.items():
            if child.type == kind:
                return name, child
        return None

    def frozen_models(self) -> list[tuple[str, FrozenModel]]:
        """(dotted path of the child, its declaration) of every child that needs a frozen model."""
        found = [(f"model.head.losses.{name}", child.frozen_model()) for name, child in self.losses.items()]
        return [(field, need) for field, need in found if need is not None]

    @property
    def is_dpo(self) -> bool:
        return any(child.type == "dpo" for child in self.losses.values())

    def monolithic(self) -> MonolithicLossConfig:
        """The shared-softmax part of this head (everything but DPO)."""
        return MonolithicLossConfig(
            children={n: c for n, c in self.losses.items() if c.type != "dpo"},
            use_triton=self.use_triton,
            logit_scale=self.logit_scale,
            softcap=self.softcap,
            chunk_tokens=self.chunk_tokens,
        )
