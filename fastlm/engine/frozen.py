"""Frozen models next to the trained one: a distillation teacher or a DPO reference.

A frozen model is loaded from a fastlm checkpoint (its architecture from the checkpoint's manifest,
so it may differ from the student's), or copied from the policy; it stays in eval mode with no
gradients, and its logits go through its own head's logit transform.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import TypeAdapter, ValidationError

from fastlm.engine.checkpoint import (
    LATEST_FILE,
    CheckpointError,
    LoadedCheckpoint,
    load_checkpoint,
    load_latest_checkpoint,
)
from fastlm.lora.attach import AdapterSnapshot, BaseView, adapter_mismatches, lora_layers
from fastlm.losses.spec import TeacherHead, transform_logits
from fastlm.models.config import ModelConfig
from fastlm.models.decoder import DecoderLM, build_model

CHECKPOINTS = "checkpoints"


def find_checkpoint(path: str | Path, field: str) -> LoadedCheckpoint:
    """Accepts a run dir, its `checkpoints/` dir, the `latest` pointer file, or one `step-*` dir.

    `field` is the config key that named the path, for the error message.
    """
    path = Path(path)
    if path.is_file() and path.name == LATEST_FILE:
        return load_latest_checkpoint(path.parent)
    if (path / "manifest.json").is_file():
        return load_checkpoint(path)
    if (path / CHECKPOINTS).is_dir():
        return load_latest_checkpoint(path / CHECKPOINTS)
    if path.is_dir():
        return load_latest_checkpoint(path)
    raise CheckpointError(
        f"{field}: no checkpoint at {path}; train that model first (e.g. `fastlm train configs/tiny.yaml` "
        "writes runs/tiny/checkpoints/latest) or point it at a run, checkpoints/ or step-* directory"
    )


def freeze(model: DecoderLM) -> DecoderLM:
    """Eval mode (no dropout) and no parameter gradients."""
    model.eval()
    model.requires_grad_(False)
    return model


def load_frozen_model(path: str | Path, field: str, device: torch.device) -> DecoderLM:
    """The checkpoint's model, built from its manifest's model config, with its weights, frozen."""
    loaded = find_checkpoint(path, field)
    try:
        config = TypeAdapter(ModelConfig).validate_python(loaded.config.get("model"))
    except ValidationError as error:
        raise CheckpointError(f"{field}: {loaded.path}/manifest.json has no valid model config ({error})") from error
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # keep the run's RNG stream
        model = build_model(config, device=device)
    loaded.load_model(model, device)
    return freeze(model)


def copy_frozen(model: torch.nn.Module, device: torch.device) -> DecoderLM:
    """A frozen copy of `model` as it is now (e.g. the initial policy), unwrapping a DDP wrapper. A LoRA
    model's is an `AdapterSnapshot`: a copy of its adapters (and trained head) over its own frozen base."""
    source: DecoderLM = getattr(model, "module", model)
    if lora_layers(source):
        return AdapterSnapshot(source)  # type: ignore[return-value]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        copy = build_model(source.config, device=device)
    copy.load_state_dict(source.state_dict())
    return freeze(copy)


def load_frozen_copy(path: Path, model: torch.nn.Module, device: torch.device) -> DecoderLM:
    """A `copy_frozen` of `model` saved at `path` (its `checkpointed` state), read back: a LoRA model's
    saved adapters over its own base, else the whole saved model."""
    source = getattr(model, "module", model)
    if not lora_layers(source):
        return load_frozen_model(path, str(path), device)
    state = find_checkpoint(path, str(path)).model_state()
    wrong = adapter_mismatches(source, state)
    if wrong:
        raise CheckpointError(f"{path}: adapter tensors that do not fit this model.lora: {', '.join(wrong[:4])}")
    return AdapterSnapshot(source, state)  # type: ignore[return-value]


def reference_model(model: torch.nn.Module, path: str | None, field: str, device: torch.device) -> DecoderLM:
    """The frozen reference of a DPO or policy loss with a KL penalty: a copy of `model` as it is now
    (called before any step: the initial policy, which a resume rebuilds from the seed; an RL run with a
    supervised warm-up copies the policy at its first RL step instead, rl/objective.py), or the checkpoint
    at `path` (named by the config key `field`; preflight checked it fits). A LoRA model's initial policy is
    its base: the same weights with the adapters switched off, no copy."""
    if path is None:
        source = getattr(model, "module", model)
        return BaseView(source) if lora_layers(source) else copy_frozen(model, device)
    return load_frozen_model(path, field, device)  # its vocab and length were checked at the start (preflight)


def frozen_logits(model: DecoderLM, input_ids: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """(B, S, V) logits as the frozen model's softmax sees them (its own logit_scale / softcap applied)."""
    head = model.config.head
    return transform_logits(model.logits(input_ids, document_ids), head.logit_scale, head.softcap)


def frozen_head_input(model: DecoderLM, input_ids: torch.Tensor, document_ids: torch.Tensor) -> TeacherHead:
    """The frozen model's final hidden states (B, S, Ht) and output weight, with its own logit transform:
    a chunked head computes its logits per chunk (`frozen_logits` without the (B, S, V) tensor)."""
    head = model.config.head
    return TeacherHead(model.hidden_states(input_ids, document_ids), model.output_weight, head.logit_scale, head.softcap)
