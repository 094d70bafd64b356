"""What `fastlm validate` (and the dry run) says about `model.lora`: problems `train` would hit, and the
trainable / total split with its memory estimate."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fastlm.config.errors import ConfigIssue
from fastlm.lora.attach import (
    LoraTargetError,
    adapter_mismatches,
    attach_lora,
    select_targets,
)
from fastlm.lora.peft import (
    FASTLM_ADAPTER_FILE,
    PEFT_CONFIG_FILE,
    PEFT_WEIGHTS_FILE,
    PeftFormatError,
    read_adapter_folder,
)
from fastlm.models.decoder import build_model

if TYPE_CHECKING:
    from fastlm.run_config.schema import RunConfig

GIB = 2**30


def lora_issues(config: RunConfig) -> list[ConfigIssue]:
    """Targets that match no linear, a head that cannot be trained alone, an adapter_path that is no adapter."""
    lora = config.model.lora
    if lora is None:
        return []
    issues = []
    try:
        select_targets(build_model(config.model, "meta"), lora.targets)
    except LoraTargetError as error:
        issues.append(ConfigIssue("model.lora.targets", str(error), lora.targets,
                                  hint="name fastlm roles (attn.q, mlp.*), PEFT modules (q_proj) or all-linear"))
    if lora.train_head and config.model.tie_embeddings:
        issues.append(ConfigIssue("model.lora.train_head", "the output matrix is the token embedding here "
                                  "(model.tie_embeddings: true)", True, hint="set train_head: false, or untie the embeddings"))
    if lora.adapter_path is not None and not issues:
        issues += _adapter_path_issues(config)
    return issues


def _adapter_path_issues(config: RunConfig) -> list[ConfigIssue]:
    """The adapter folder is one, and its tensors fit this model.lora (read now: adapters are small)."""
    lora = config.model.lora
    path = Path(lora.adapter_path)
    hint = "point it at a PEFT adapter folder or a `fastlm convert --from-peft` output"
    if not (
        (path / PEFT_CONFIG_FILE).is_file() and (path / PEFT_WEIGHTS_FILE).is_file() or (path / FASTLM_ADAPTER_FILE).is_file()
    ):
        return [ConfigIssue("model.lora.adapter_path", f"holds neither a PEFT adapter ({PEFT_CONFIG_FILE} + "
                            f"{PEFT_WEIGHTS_FILE}) nor {FASTLM_ADAPTER_FILE}", str(path), hint=hint)]
    model = build_model(config.model, "meta")
    targets = attach_lora(model, lora)
    try:
        wrong = adapter_mismatches(model, read_adapter_folder(path, model, targets, lora))
    except (PeftFormatError, OSError, ValueError) as error:
        return [ConfigIssue("model.lora.adapter_path", f"unreadable adapter: {str(error)[:300]}", str(path), hint=hint)]
    if wrong:
        return [ConfigIssue("model.lora.adapter_path", f"adapter tensors that do not fit model.lora: {', '.join(wrong[:4])}",
                            str(path), hint="match model.lora.rank and targets to the adapter (see its lora.yaml)")]
    return []


def lora_split(config: RunConfig, base_dtype: torch.dtype | None) -> tuple[int, int, int, int]:
    """(trainable, total, base parameters, training bytes) of a LoRA run: frozen linear weights in `base_dtype`,
    the rest of the base fp32; trained tensors with fp32 grads and AdamW (16 bytes each)."""
    model = build_model(config.model, "meta")
    attach_lora(model, config.model.lora, base_dtype=base_dtype)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    base = sum(p.numel() for name, p in model.named_parameters() if ".lora_" not in name)
    frozen_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    return trainable, total, base, frozen_bytes + 16 * trainable


def describe_lora(config: RunConfig, base_dtype: torch.dtype | None) -> str:
    """The dry run's LoRA line: trainable vs total parameters and the training memory of that split."""
    trainable, total, base, memory = lora_split(config, base_dtype)
    dtype = str(base_dtype or torch.float32).removeprefix("torch.")
    return (f"LoRA: {trainable:,} trainable of {total:,} parameters ({100 * trainable / total:.2f}%); estimated "
            f"training memory (frozen base linears in {dtype}, trained tensors + grads + AdamW fp32): "
            f"{memory / GIB:.3f} GiB (full fine-tune: {16 * base / GIB:.3f} GiB)")
