"""fastlm adapters <-> HF PEFT's LoRA files (`adapter_model.safetensors` + `adapter_config.json`), exactly.

Each fastlm slice adapter (A_s: r x in, B_s: rows x r) lands in the HF module its rows are exported as
(`Target.peft`). Where one HF module holds one slice (Llama's q_proj, gate_proj, ...), the factors are
copied. Where it holds several (GPT-2's fused c_attn), its PEFT adapter is A = [A_q; A_k; A_v] with B
block-diagonal, rank n*r, its alpha set (`alpha_pattern`) so that PEFT's scale is ours: B A then equals
the slices' deltas row for row. Import inverts this (a slice keeps the columns of B that are not zero).

An adapter folder is checked before anything is built from it: adapter_config.json read within bounds
(`fastlm.system.json_text`) and held to a schema (r a whole number >= 1, lora_alpha finite and > 0, the
patterns' values alike, target_modules names, dropout in [0, 1)), the safetensors file readable, and each
module's factors a pair of finite 2-D float tensors whose rank is the one the config gives that module. So
the largest tensor made is the size of the ones in the file; any problem is one `PeftFormatError` line.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from fastlm.lora.attach import Target
from fastlm.models.lora_config import LoraConfig
from fastlm.system.json_text import JsonTextError, parse_json, read_json_bytes

PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
HEAD_STATE = "lm_head_weight"


MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json is a few KiB
_FACTOR = re.compile(r"(.+)\.lora_([AB])\.weight")


class PeftFormatError(ValueError):
    """A PEFT adapter that is damaged, or cannot be expressed on this model's targets."""


class AdapterFitError(PeftFormatError):
    """A sound adapter that does not fit this run's model.lora (its rank or targets): the config is to change."""


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
    """adapter_config.json (schema-checked) and the adapter tensors of a PEFT folder (safetensors only)."""
    directory = Path(directory)
    path = directory / PEFT_CONFIG_FILE
    try:
        adapter_config = parse_json(read_json_bytes(path, MAX_CONFIG_BYTES))
    except (JsonTextError, OSError) as error:
        raise PeftFormatError(f"{path}: not a PEFT adapter config ({error}); point at a PEFT LoRA adapter folder "
                              f"({PEFT_CONFIG_FILE} + {PEFT_WEIGHTS_FILE})") from None
    check_adapter_config(adapter_config, path)
    return adapter_config, load_tensors(directory / PEFT_WEIGHTS_FILE)


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file of adapter tensors, each finite; a damaged one is a `PeftFormatError` naming it."""
    from safetensors.torch import load_file

    if not path.is_file():
        raise PeftFormatError(f"{path}: missing or not a regular file")
    try:
        tensors = load_file(str(path))
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error type for a bad header or body
        raise PeftFormatError(f"{path}: not a readable safetensors file ({str(error)[:200]})") from None
    for name, value in tensors.items():
        if not value.is_floating_point() or not bool(torch.isfinite(value).all()):
            what = "not floating point" if not value.is_floating_point() else "holds NaN or inf"
            raise PeftFormatError(f"{path}: tensor {name[:200]} {what} ({value.dtype}); the adapter is damaged")
    return tensors


def _whole(value: Any) -> bool:
    return type(value) is int and value >= 1


def _positive(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and value > 0


def _names(value: Any) -> bool:
    return isinstance(value, str) and bool(value) or isinstance(value, list) and bool(value) and all(
        isinstance(name, str) and name for name in value)


def _pattern(value: Any, check: Any) -> bool:
    """PEFT's rank_pattern / alpha_pattern: None or {regex: value}."""
    if value is None:
        return True
    if not isinstance(value, dict) or not all(isinstance(key, str) and key and check(v) for key, v in value.items()):
        return False
    try:
        for key in value:
            re.compile(key)
    except re.error:
        return False
    return True


def check_adapter_config(adapter_config: Any, path: Path) -> None:
    """Every field fastlm reads has its type and range (see the module docstring); one line naming the key."""
    if not isinstance(adapter_config, dict):
        raise PeftFormatError(f"{path}: must hold a JSON object, not {type(adapter_config).__name__}")
    dropout = adapter_config.get("lora_dropout")
    checks: list[tuple[str, bool, str]] = [
        ("peft_type", adapter_config.get("peft_type") == "LORA", "LORA"),
        ("r", _whole(adapter_config.get("r")), "a whole number >= 1"),
        ("lora_alpha", _positive(adapter_config.get("lora_alpha")), "a finite number > 0"),
        ("target_modules", _names(adapter_config.get("target_modules")), "a module name or a list of them"),
        ("rank_pattern", _pattern(adapter_config.get("rank_pattern"), _whole), "{regex: whole number >= 1}"),
        ("alpha_pattern", _pattern(adapter_config.get("alpha_pattern"), _positive), "{regex: finite number > 0}"),
        ("lora_dropout", dropout is None or type(dropout) in (int, float) and 0 <= dropout < 1, "a number in [0, 1)"),
        ("use_rslora", adapter_config.get("use_rslora") in (None, True, False), "true or false"),
        ("modules_to_save", adapter_config.get("modules_to_save") is None or _names(adapter_config["modules_to_save"]),
         "a list of module names"),
        ("base_model_name_or_path", adapter_config.get("base_model_name_or_path") is None
         or isinstance(adapter_config["base_model_name_or_path"], str), "a path"),
    ]
    for key, ok, expected in checks:
        if not ok:
            raise PeftFormatError(f"{path}: '{key}' must be {expected}, got {adapter_config.get(key)!r:.80}; fix the "
                                  "adapter config (or export the adapter again)")
    unsupported = {
        key: adapter_config.get(key) for key in ("use_dora", "bias") if adapter_config.get(key) not in (None, False, "none")
    }
    if unsupported:
        raise PeftFormatError(f"{path}: {unsupported} is not plain LoRA (fastlm trains no DoRA magnitudes or biases)")


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches the end of the module's dotted name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def module_ranks(adapter_config: dict[str, Any], tensors: dict[str, torch.Tensor], source: str,
                 head_module: str | None) -> dict[str, int]:
    """HF module -> the rank of its adapter, after checking that every tensor is a factor (or the head) and each
    module has A (rank x in) and B (out x rank) of the rank the config gives it."""
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        match = _FACTOR.fullmatch(name[len(PREFIX):]) if name.startswith(PREFIX) else None
        if match is None:
            if head_module is not None and name == f"{PREFIX}{head_module}.weight":
                continue
            raise PeftFormatError(f"{source}: tensor {name[:200]!r} is no LoRA factor fastlm imports (lora_A / lora_B "
                                  "weights, and the output matrix of modules_to_save)")
        factors.setdefault(match.group(1), {})[match.group(2)] = value
    ranks = {}
    for module, pair in sorted(factors.items()):
        rank = _pattern_value(adapter_config.get("rank_pattern") or {}, module, adapter_config["r"])
        down, up = pair.get("A"), pair.get("B")
        if down is None or up is None or down.dim() != 2 or up.dim() != 2 or down.shape[0] != rank \
                or up.shape[1] != rank:
            shapes = {factor: tuple(value.shape) for factor, value in sorted(pair.items())}
            raise PeftFormatError(f"{source}: {module}'s factors are {shapes}, but rank {rank} ({PEFT_CONFIG_FILE}) "
                                  "needs lora_A (rank, in) and lora_B (out, rank); the adapter is damaged")
        ranks[module] = rank
    if not ranks:
        raise PeftFormatError(f"{source}: {PEFT_WEIGHTS_FILE} holds no LoRA factors")
    return ranks


def lora_config_from_peft(adapter_config: dict[str, Any], ranks: dict[str, int]) -> LoraConfig:
    """The `model.lora` that holds a PEFT adapter exactly: its largest rank (`module_ranks`), its scale, its
    target names."""
    rank = max(ranks.values())
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
    ranks = module_ranks(adapter_config, tensors, source, head_module)
    by_module: dict[str, list[Target]] = {}
    for target in targets:
        for piece in target.peft:
            by_module.setdefault(piece.name, []).append(target)
    state: dict[str, torch.Tensor] = {}
    for module, rank in ranks.items():
        members = by_module.get(module)
        if not members:
            raise AdapterFitError(f"{source}: the adapter on {module} has no place among model.lora.targets "
                                  f"{config.targets}")
        down, up = tensors[_key(module, "A")].float(), tensors[_key(module, "B")].float()
        alpha = float(_pattern_value(adapter_config.get("alpha_pattern") or {}, module, adapter_config["lora_alpha"]))
        ratio = alpha / (math.sqrt(rank) if adapter_config.get("use_rslora") else rank) / config.scale
        piece = next(p for p in members[0].peft if p.name == module)
        if up.shape[0] != piece.size:
            raise PeftFormatError(f"{source}: {module}'s lora_B has {up.shape[0]} rows, but the module has {piece.size}; "
                                  "the adapter is for another model")
        for target in members:
            s = target.slice
            if s.start < piece.start or s.start + s.size > piece.start + piece.size:
                raise PeftFormatError(f"{source}: {target.path} spans several PEFT modules; it cannot be imported")
            rows = up[s.start - piece.start:s.start - piece.start + s.size]
            columns = torch.arange(up.shape[1]) if up.shape[1] <= config.rank else rows.ne(0).any(0).nonzero()[:, 0]
            if len(columns) > config.rank:
                raise AdapterFitError(f"{source}: {module} needs rank {len(columns)} for {target.path}, more than "
                                      f"model.lora.rank {config.rank}")
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
    directory = Path(directory)
    if (directory / PEFT_CONFIG_FILE).is_file():
        adapter_config, tensors = read_peft(directory)
        head_module, _ = hf_layout(model.config, targets)
        return from_peft(targets, adapter_config, tensors, config, head_module, str(directory))
    if not (directory / FASTLM_ADAPTER_FILE).is_file():
        raise PeftFormatError(f"model.lora.adapter_path: {directory} holds neither {PEFT_CONFIG_FILE} (a PEFT adapter) "
                              f"nor {FASTLM_ADAPTER_FILE} (a `fastlm convert --from-peft` output)")
    return load_tensors(directory / FASTLM_ADAPTER_FILE)
