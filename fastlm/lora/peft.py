"""fastlm adapters <-> HF PEFT's LoRA files (`adapter_model.safetensors` + `adapter_config.json`), exactly.

Each fastlm slice adapter (A_s: r x in, B_s: rows x r) lands in the HF module its rows are exported as
(`Target.peft`). Where one HF module holds one slice (Llama's q_proj, gate_proj, ...), the factors are
copied. Where it holds several (GPT-2's fused c_attn), its PEFT adapter is A = [A_q; A_k; A_v] with B
block-diagonal, rank n*r, its alpha set (`alpha_pattern`) so that PEFT's scale is ours: B A then equals
the slices' deltas row for row. Import inverts this (a slice keeps the columns of B that are not zero).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from fastlm.lora.attach import Target
from fastlm.models.lora_config import LoraConfig

PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
HEAD_STATE = "lm_head_weight"


class PeftFormatError(ValueError):
    """A PEFT adapter that cannot be expressed on this model's targets."""


def _key(module: str, factor: str) -> str:
    return f"{PREFIX}{module}.lora_{factor}.weight"


def _fastlm_key(target: Target, factor: str) -> str:
    return f"{target.module}.lora_{factor}.{target.slice.role}"


def hf_layout(model_config: Any, targets: list[Target]) -> tuple[str | None, bool]:
    """(the HF output-matrix module, PEFT's fan_in_fan_out: the targets' HF weights are stored transposed,
    GPT-2's Conv1D) from the family's HF weight table."""
    from fastlm.models.hf import weight_rules

    rules = {rule.ours: rule for rule in weight_rules(model_config)}
    for target in targets:  # a slice whose rows the checkpoint orders otherwise (GLM-4's q/k: interleaved RoPE)
        rows = getattr(rules.get(f"{target.module}.weight"), "rows", None)
        span = range(target.slice.start, target.slice.start + target.slice.size)
        if rows is not None and list(rows[span.start:span.stop]) != list(span):
            raise PeftFormatError(f"PEFT adapters on {target.module} ({target.slice.role}) are not supported: the "
                                  "checkpoint orders its rows otherwise (GLM-4's interleaved rotary dims); target other "
                                  "modules, or merge the adapters")
    head = rules.get(HEAD_STATE)
    transposed = any(rules[f"{t.module}.weight"].transpose for t in targets if f"{t.module}.weight" in rules)
    return (head.theirs[0].removesuffix(".weight") if head else None), transposed


def _alpha_for(config: LoraConfig, rank: int) -> float:
    """PEFT's lora_alpha for a module of `rank` whose scale must be `config.scale`."""
    return config.scale * (math.sqrt(rank) if config.rslora else rank)


def to_peft(targets: list[Target], state: dict[str, torch.Tensor], config: LoraConfig, base_path: str | None,
            head_module: str | None, fan_in_fan_out: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(PEFT tensors, adapter_config.json) of the adapters in `state` (fastlm names, see `attach_lora`)."""
    by_module: dict[str, list[Target]] = {}
    for target in targets:
        for piece in target.peft:
            by_module.setdefault(piece.name, []).append(target)
    tensors: dict[str, torch.Tensor] = {}
    ranks: dict[str, int] = {}
    for module, members in by_module.items():
        piece = next(p for p in members[0].peft if p.name == module)
        rank = config.rank * len(members)
        up = torch.zeros(piece.size, rank)
        for index, target in enumerate(members):
            s = target.slice
            first, last = max(s.start, piece.start), min(s.start + s.size, piece.start + piece.size)
            up[first - piece.start:last - piece.start, index * config.rank:(index + 1) * config.rank] = \
                state[_fastlm_key(target, "B")][first - s.start:last - s.start].float()
        tensors[_key(module, "A")] = torch.cat([state[_fastlm_key(t, "A")].float() for t in members]).contiguous()
        tensors[_key(module, "B")] = up
        ranks[module] = rank
    if config.train_head:
        tensors[f"{PREFIX}{head_module}.weight"] = state[HEAD_STATE].float().contiguous()
    odd = {module: rank for module, rank in ranks.items() if rank != config.rank}
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_path,
        "r": config.rank, "lora_alpha": config.alpha, "use_rslora": config.rslora, "lora_dropout": config.dropout,
        "target_modules": sorted(ranks), "rank_pattern": odd,
        "alpha_pattern": {module: _alpha_for(config, rank) for module, rank in odd.items()},
        "fan_in_fan_out": fan_in_fan_out, "bias": "none", "init_lora_weights": True,
        "modules_to_save": [head_module] if config.train_head else None,
    }
    return tensors, adapter_config


def read_peft(directory: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """adapter_config.json and the adapter tensors of a PEFT folder (safetensors only)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    try:
        adapter_config = json.loads((directory / PEFT_CONFIG_FILE).read_text(encoding="utf-8"))
        tensors = load_file(str(directory / PEFT_WEIGHTS_FILE))
    except (OSError, ValueError) as error:
        raise PeftFormatError(f"{directory}: not a PEFT LoRA adapter folder ({PEFT_CONFIG_FILE} + "
                              f"{PEFT_WEIGHTS_FILE}): {str(error)[:200]}") from None
    if not isinstance(adapter_config, dict) or adapter_config.get("peft_type") != "LORA":
        raise PeftFormatError(f"{directory / PEFT_CONFIG_FILE}: peft_type must be LORA")
    unsupported = {
        key: adapter_config.get(key) for key in ("use_dora", "bias") if adapter_config.get(key) not in (None, False, "none")
    }
    if unsupported:
        raise PeftFormatError(f"{directory / PEFT_CONFIG_FILE}: {unsupported} is not plain LoRA (fastlm trains no DoRA "
                              "magnitudes or biases)")
    return adapter_config, tensors


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches the end of the module's dotted name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def lora_config_from_peft(adapter_config: dict[str, Any]) -> LoraConfig:
    """The `model.lora` that holds a PEFT adapter exactly: its largest rank, its scale, its target names."""
    rank = max([int(adapter_config["r"]), *map(int, (adapter_config.get("rank_pattern") or {}).values())])
    rslora = bool(adapter_config.get("use_rslora"))
    scale = float(adapter_config["lora_alpha"]) / (math.sqrt(adapter_config["r"]) if rslora else adapter_config["r"])
    targets = adapter_config["target_modules"]
    return LoraConfig(rank=rank, alpha=scale * (math.sqrt(rank) if rslora else rank), rslora=rslora,
                      dropout=float(adapter_config.get("lora_dropout") or 0.0),
                      targets=[targets] if isinstance(targets, str) else list(targets),
                      train_head=bool(adapter_config.get("modules_to_save")))


def from_peft(targets: list[Target], adapter_config: dict[str, Any], tensors: dict[str, torch.Tensor],
              config: LoraConfig, head_module: str | None, source: str) -> dict[str, torch.Tensor]:
    """fastlm adapter state (names as `attach_lora` makes them) of PEFT tensors, for `config`'s rank and scale."""
    by_module: dict[str, list[Target]] = {}
    for target in targets:
        for piece in target.peft:
            by_module.setdefault(piece.name, []).append(target)
    state: dict[str, torch.Tensor] = {}
    modules = sorted({key[len(PREFIX):].rsplit(".lora_", 1)[0] for key in tensors if ".lora_" in key})
    for module in modules:
        members = by_module.get(module)
        if not members:
            raise PeftFormatError(f"{source}: the adapter on {module} has no place among model.lora.targets "
                                  f"{config.targets}; add its name to them")
        down, up = tensors[_key(module, "A")].float(), tensors[_key(module, "B")].float()
        rank = int(_pattern_value(adapter_config.get("rank_pattern") or {}, module, adapter_config["r"]))
        alpha = float(_pattern_value(adapter_config.get("alpha_pattern") or {}, module, adapter_config["lora_alpha"]))
        ratio = alpha / (math.sqrt(rank) if adapter_config.get("use_rslora") else rank) / config.scale
        piece = next(p for p in members[0].peft if p.name == module)
        for target in members:
            s = target.slice
            if s.start < piece.start or s.start + s.size > piece.start + piece.size:
                raise PeftFormatError(f"{source}: {target.path} spans several PEFT modules; it cannot be imported")
            rows = up[s.start - piece.start:s.start - piece.start + s.size]
            columns = torch.arange(up.shape[1]) if up.shape[1] <= config.rank else rows.ne(0).any(0).nonzero()[:, 0]
            if len(columns) > config.rank:
                raise PeftFormatError(f"{source}: {module} needs rank {len(columns)} for {target.path}, more than "
                                      f"model.lora.rank {config.rank}; raise it")
            a, b = torch.zeros(config.rank, down.shape[1]), torch.zeros(s.size, config.rank)
            a[:len(columns)], b[:, :len(columns)] = down[columns], rows[:, columns] * ratio if ratio != 1.0 else rows[:, columns]
            state[_fastlm_key(target, "A")], state[_fastlm_key(target, "B")] = a, b
    head = f"{PREFIX}{head_module}.weight"
    if config.train_head and head in tensors:
        state[HEAD_STATE] = tensors[head].float()
    return state


FASTLM_ADAPTER_FILE = "adapter.safetensors"  # a `fastlm convert --from-peft` folder: fastlm names, `lora.yaml` beside


def read_adapter_folder(directory: str | Path, model: Any, targets: list[Target], config: LoraConfig) -> dict[str, torch.Tensor]:
    """The adapter state of `model.lora.adapter_path`: a PEFT folder, or a `convert --from-peft` output."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if (directory / PEFT_CONFIG_FILE).is_file():
        adapter_config, tensors = read_peft(directory)
        head_module, _ = hf_layout(model.config, targets)
        return from_peft(targets, adapter_config, tensors, config, head_module, str(directory))
    if not (directory / FASTLM_ADAPTER_FILE).is_file():
        raise PeftFormatError(f"model.lora.adapter_path: {directory} holds neither {PEFT_CONFIG_FILE} (a PEFT adapter) "
                              f"nor {FASTLM_ADAPTER_FILE} (a `fastlm convert --from-peft` output)")
    return load_file(str(directory / FASTLM_ADAPTER_FILE))
