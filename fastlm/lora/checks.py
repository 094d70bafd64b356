"""What `fastlm validate` (and the dry run) says about `model.lora`: problems `train` would hit, and the
trainable / total split with its memory estimate."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fastlm.config.errors import ConfigIssue
from fastlm.lora.attach import (
    LoraTargetError,
    Target,
    adapter_mismatches,
    attach_lora,
    select_targets,
)
from fastlm.lora.peft import (
    FASTLM_ADAPTER_FILE,
    PEFT_CONFIG_FILE,
    PEFT_WEIGHTS_FILE,
    AdapterFitError,
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
    model = build_model(config.model, "meta")
    try:
        targets = select_targets(model, lora.targets)
    except LoraTargetError as error:
        issues.append(ConfigIssue("model.lora.targets", str(error), lora.targets,
                                  hint="name fastlm roles (attn.q, mlp.*), PEFT modules (q_proj) or all-linear"))
    else:
        experts = expert_parameters(model)
        if experts and not lora.frozen_experts:
            total = sum(p.numel() for p in model.parameters())
            issues.append(ConfigIssue(
                "model.lora.targets", f"leave this mixture-of-experts model's routed experts without adapters ({experts:,} "
                f"of its {total:,} parameters stay the base's); adapters go on {adapted_roles(targets)}", lora.targets,
                hint="set model.lora.frozen_experts: true to train those adapters anyway, or fine-tune in full (no "
                "model.lora)"))
    if lora.train_head and config.model.tie_embeddings:
        issues.append(ConfigIssue("model.lora.train_head", "the output matrix is the token embedding here "
                                  "(model.tie_embeddings: true)", True, hint="set train_head: false, or untie the embeddings"))
    if lora.adapter_path is not None and not issues:
        issues += _adapter_path_issues(config)
    return issues


def expert_parameters(model: torch.nn.Module) -> int:
    """Parameters of the routed experts (no adapter can sit on their stacked weights): 0 for a dense model."""
    from fastlm.layers.moe import MoEMLP

    return sum(module.gate_up_proj.numel() + module.down_proj.numel() for module in model.modules()
               if isinstance(module, MoEMLP))


def adapted_roles(targets: list[Target]) -> str:
    """The roles that get adapters (`attn.q, attn.k, mlp.router`), each once whatever the layers."""
    roles = dict.fromkeys(target.path.split(".", 2)[-1] if target.path.startswith("blocks.") else target.path
                          for target in targets)
    return ", ".join(roles) or "nothing"


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
    fit = "match model.lora.rank and targets to the adapter (its adapter_config.json or lora.yaml)"
    try:
        wrong = adapter_mismatches(model, read_adapter_folder(path, model, targets, lora))
    except AdapterFitError as error:
        return [ConfigIssue("model.lora.adapter_path", f"does not fit model.lora: {str(error)[:300]}", str(path), hint=fit)]
    except (PeftFormatError, OSError, ValueError) as error:
        return [ConfigIssue("model.lora.adapter_path", f"unreadable adapter: {str(error)[:300]}", str(path), hint=hint)]
    if wrong:
        return [ConfigIssue("model.lora.adapter_path", f"adapter tensors that do not fit model.lora: {', '.join(wrong[:4])}",
                            str(path), hint=fit)]
    return []


def lora_split(config: RunConfig, base_dtype: torch.dtype | None) -> tuple[int, int, int, int]:
    """(trainable, total, base parameters, training bytes) of a LoRA run: frozen linear weights in `base_dtype`,
    the rest of the base fp32; trained tensors with fp32 grads and AdamW (16 bytes each)."""
    model = build_model(config.model, "meta")
    attach_lora(model, config.model.lora, base_dtype=base_dtype)
    return _split(model)


def _split(model: torch.nn.Module) -> tuple[int, int, int, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    base = sum(p.numel() for name, p in model.named_parameters() if ".lora_" not in name)
    frozen_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    return trainable, total, base, frozen_bytes + 16 * trainable


def describe_lora(config: RunConfig, base_dtype: torch.dtype | None) -> str:
    """The dry run's LoRA line: which modules get adapters, trainable vs total parameters and the training memory
    of that split."""
    model = build_model(config.model, "meta")
    targets = attach_lora(model, config.model.lora, base_dtype=base_dtype)
    trainable, total, base, memory = _split(model)
    dtype = str(base_dtype or torch.float32).removeprefix("torch.")
    experts = expert_parameters(model)
    frozen = f"; the routed experts ({experts:,} parameters) get none (model.lora.frozen_experts)" if experts else ""
    return (f"LoRA: adapters on {adapted_roles(targets)}{frozen}; {trainable:,} trainable of {total:,} parameters "
            f"({100 * trainable / total:.2f}%); estimated training memory (frozen base linears in {dtype}, trained "
            f"tensors + grads + AdamW fp32): {memory / GIB:.3f} GiB (full fine-tune: {16 * base / GIB:.3f} GiB)")
