"""Process-level facts of a run: which device, which autocast, and the RNG state that resume restores."""

from __future__ import annotations

import os
import random
from typing import TYPE_CHECKING, Any

import torch

from fastlm.engine.config import TrainerConfig

if TYPE_CHECKING:
    from fastlm.run_config.schema import RunConfig


def select_device(config: TrainerConfig) -> torch.device:
    """`auto` picks CUDA when present; asking for CUDA without one is an error, not a silent CPU run."""
    if config.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device is 'cuda' but no CUDA device is available; use 'auto' or 'cpu'")
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def autocast_dtype(config: TrainerConfig, device: torch.device) -> torch.dtype | None:
    """bf16 autocast for `bf16`, and for `auto` on CUDA; None means plain fp32."""
    if config.precision == "bf16" or (config.precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def describe_head(config: RunConfig, device: torch.device) -> str:
    """The LM head's line of the dry run and the wandb config: the loss implementation on `device`, and
    which head runs (chunked or full logits) with its chunk size at one micro-batch of the run."""
    from fastlm.layers.lm_head import LMHead  # lazy: the head imports the losses stack

    tokens = config.data.micro_batch_size * config.data.seq_len
    vocab = config.model.vocab_size // config.distributed.tensor_parallel
    dtype = autocast_dtype(config.trainer, device) or torch.float32
    return LMHead(config.model.head, device).describe(tokens, vocab, dtype)


DEFAULT_MAX_THREADS = 4  # the CPU demos run 2.5-10x slower with every core of a shared 2-core machine


def cpu_threads(setting: int | None) -> int:
    """`run.threads`, or this process's share of the cores it may use (torchrun's LOCAL_WORLD_SIZE processes
    share them), at most DEFAULT_MAX_THREADS."""
    if setting is not None:
        return setting
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, min(DEFAULT_MAX_THREADS, cores // max(processes, 1)))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def rng_state() -> dict[str, Any]:
    """torch (CPU and every CUDA device) and python RNG states, in a form `torch.load(weights_only=True)` reads."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
