"""`trainer.compile`: whether to torch.compile the decoder blocks, and the eager fallback when it fails.

Compilation is lazy (dynamo and inductor run inside the first forward and backward), so a failure
shows up in the first micro-batch: `CompileFallback.run` catches it there once, prints one line,
drops the compiled blocks and runs the micro-batch again eagerly. Later failures are real errors.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Literal, TypeVar

import torch

from fastlm.layers.attention_kernels import FLEX_MIN_HEAD_DIM, flex_supported
from fastlm.layers.packed_attention import packed_kind
from fastlm.models.decoder import DecoderLM
from fastlm.system.errors import first_line

Result = TypeVar("Result")


def compile_wanted(setting: Literal["auto"] | bool, device: torch.device, data_parallel: str | None = None) -> bool:
    """auto: on CUDA, except under FSDP (its per-block hooks and compiled blocks are not tested together here)."""
    if setting == "auto":
        return device.type == "cuda" and data_parallel != "fsdp"
    return bool(setting)


def describe_training_path(setting: Literal["auto"] | bool, checkpointing: bool, device: torch.device, head_dim: int,
                           data_parallel: str | None = None) -> str:
    """One line for the dry run: compiled or eager blocks, the attention of packed rows, checkpointing."""
    compiled = compile_wanted(setting, device, data_parallel)
    blocks = "blocks compiled" if compiled else "eager blocks"
    attention = "FlexAttention block mask" if packed_kind(device, head_dim) == "flex" else "SDPA with a dense mask"
    if device.type == "cuda" and not flex_supported(device, head_dim):
        attention += f" (head_dim {head_dim} < {FLEX_MIN_HEAD_DIM}, FlexAttention's minimum)"
    return (f"training path: {blocks} (trainer.compile={str(setting).lower()} on {device.type}), packed rows "
            f"through {attention}, activation checkpointing {'on' if checkpointing else 'off'}")


class CompileFallback:
    """Runs the first compiled micro-batch under a guard; on failure, note it once and go eager."""

    def __init__(self, model: DecoderLM, verbose: bool = True) -> None:
        self.model = model
        self.verbose = verbose
        self.pending = model.blocks_compiled  # nothing to guard when nothing was compiled
        self.note: str | None = None

    def run(self, step: Callable[[], Result], reset: Callable[[], None]) -> Result:
        """`step` runs one micro-batch (forward and backward); `reset` undoes what a failed attempt left
        (gradients). Only the first call is guarded."""
        if not self.pending:
            return step()
        self.pending = False
        try:
            return step()
        except Exception as error:  # noqa: BLE001 - any compiler failure means "train eagerly"
            self.model.uncompile_blocks()
            reset()
            self.note = f"fastlm: torch.compile failed ({first_line(error)}); training eagerly (trainer.compile=false hides this)"
            if self.verbose:
                print(self.note, file=sys.stderr, flush=True)
            return step()
