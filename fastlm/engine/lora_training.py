"""LoRA in the trainer: adapters on the built (and base-loaded) model, and adapter-only checkpoints that name
their base (`run.init_path` and the base weights' fingerprint), checked on resume."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from pydantic import TypeAdapter, ValidationError
from torch import nn

from fastlm.config.errors import ConfigError
from fastlm.data.config import TokenizerConfig
from fastlm.data.tokenizer import Tokenizer, build_tokenizer
from fastlm.engine.checkpoint import CheckpointError, LoadedCheckpoint
from fastlm.engine.frozen import find_checkpoint
from fastlm.engine.runtime import autocast_dtype, seed_everything
from fastlm.lora.attach import (
    Target,
    adapter_mismatches,
    attach_lora,
    base_fingerprint,
    lora_layers,
    trainable_names,
)
from fastlm.lora.peft import read_adapter_folder
from fastlm.models.config import ModelConfig
from fastlm.models.decoder import DecoderLM, build_model

if TYPE_CHECKING:
    from fastlm.run_config.schema import RunConfig


def setup_lora(model: nn.Module, config: RunConfig, device: torch.device) -> dict[str, Any] | None:
    """With `model.lora`: adapters on `model` (from `adapter_path` if set), the base frozen in
    `lora_base_dtype`; returns the base's identity (`run.init_path`, fingerprint) for checkpoints."""
    lora = config.model.lora
    if lora is None:
        return None
    identity = {"init_path": config.run.init_path, "fingerprint": base_fingerprint(model)}
    targets = attach_lora(model, lora, config.run.seed, lora_base_dtype(config, device))
    if lora.adapter_path is not None:
        load_adapters(model, read_adapter_folder(lora.adapter_path, model, targets, lora), lora.adapter_path)
    return identity


def lora_base_dtype(config: RunConfig, device: torch.device) -> torch.dtype | None:
    """The frozen base's linear weights: the run's autocast dtype, fp32 under FSDP (one dtype per block)."""
    return None if config.distributed.data_parallel == "fsdp" else autocast_dtype(config.trainer, device)


def load_adapters(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Adapter tensors into the model; one that has no place there, or a wrong shape, is an error naming `source`."""
    wrong = adapter_mismatches(model, state)
    if wrong:
        raise CheckpointError(f"{source}: adapter tensors that do not fit this model.lora: {', '.join(wrong[:4])}")
    trainable = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            trainable[name].copy_(value)


def checkpointed(model: nn.Module, full_state: dict[str, torch.Tensor] | None = None) -> Any:
    """What a checkpoint holds of the model: all of it (the module, or the gathered `full_state`: empty on
    ranks other than 0 under FSDP), or with adapters only the trained tensors (adapters, and the head with
    `train_head`)."""
    if not lora_layers(model):
        return model if full_state is None else full_state
    state = model.state_dict() if full_state is None else full_state
    return {name: state[name].detach().cpu().contiguous() for name in trainable_names(model) if name in state}


def checkpointed_shapes(config: RunConfig) -> dict[str, tuple[int, ...]]:
    """Name -> full shape of each tensor `checkpointed` writes for this run's model."""
    model = build_model(config.model, "meta")
    if config.model.lora is not None:
        attach_lora(model, config.model.lora)
    kept = set(trainable_names(model)) if lora_layers(model) else None
    return {name: tuple(value.shape) for name, value in model.state_dict().items() if kept is None or name in kept}


def restore_model(loaded: LoadedCheckpoint, model: nn.Module, device: torch.device, base: dict[str, Any] | None) -> None:
    """Load a single-process checkpoint into `model`: all of it, or with adapters the adapters, after checking
    that they were trained on this run's base (`base`: what `setup_lora` returned)."""
    if base is None:
        loaded.load_model(model, device)
        return
    check_base(loaded, base)
    state = loaded.model_state()
    missing = sorted(set(trainable_names(model)) - set(state))
    if missing:
        raise CheckpointError(f"{loaded.path}: adapter tensors missing ({', '.join(missing[:3])}); was model.lora changed?")
    load_adapters(model, state, str(loaded.path))


def check_base(loaded: LoadedCheckpoint, base: dict[str, Any]) -> None:
    stored = loaded.trainer_state.get("lora_base")
    if stored != base:
        described = stored if isinstance(stored, dict) else {}
        raise CheckpointError(
            f"{loaded.path}: its adapters belong to another base (run.init_path {described.get('init_path')!r}, "
            f"weights {str(described.get('fingerprint'))[:12]}); this run's base is run.init_path "
            f"{base['init_path']!r}, weights {base['fingerprint'][:12]}. Point run.init_path at that base, or start over")


def load_lora_run(source: str, field: str = "--from") -> tuple[DecoderLM, list[Target], str | None, Tokenizer]:
    """A LoRA run's model (`fastlm convert`, `fastlm generate`) on CPU in fp32: the base rebuilt as the trainer
    built it (`run.seed`, then `run.init_path`'s weights) and checked against the checkpoint's fingerprint,
    the adapters loaded; with its targets, its `run.init_path` and its tokenizer."""
    loaded = find_checkpoint(source, field)
    stored = loaded.config
    try:
        model_config = TypeAdapter(ModelConfig).validate_python(stored.get("model"))
        run = stored.get("run") or {}
        init_path, seed = run.get("init_path"), int(run.get("seed", 0))
        tokenizer_config = TypeAdapter(TokenizerConfig | None).validate_python((stored.get("data") or {}).get("tokenizer"))
    except (ValidationError, ValueError, TypeError, AttributeError) as error:
        raise ConfigError(f"{loaded.path}: stored config is invalid: {str(error)[:300]}") from None
    if model_config.lora is None:
        raise ConfigError(f"{field}: {loaded.path} is not a LoRA run (no model.lora); use --to-hf alone")
    seed_everything(seed)  # the trainer's base: seeded init, then run.init_path's weights
    model = build_model(model_config, "cpu")
    if init_path is not None:
        from fastlm.models.hf import load_hf_weights_into

        load_hf_weights_into(model, init_path)
    check_base(loaded, {"init_path": init_path, "fingerprint": base_fingerprint(model)})
    targets = attach_lora(model, model_config.lora)
    load_adapters(model, loaded.model_state(), str(loaded.path))
    return model, targets, init_path, build_tokenizer(tokenizer_config, init_path)
