"""Putting adapters on a built model, by module-name patterns, for any model family: every nn.Linear is a
candidate, a fused projection is cut into its roles' slices, and each slice answers to its fastlm name
(`blocks.3.attn.q`) and to the PEFT/HF module it is exported as (`model.layers.3.self_attn.q_proj`).

Also here: switching the adapters off (the reference model for free), merged weights (the rollout replica,
exports) and the adapter-only state a LoRA checkpoint holds, with the base's fingerprint.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from fastlm.lora.layer import LoraLinear, Slice, full_tensor
from fastlm.models.lora_config import LoraConfig

ALL_LINEAR = "all-linear"
FUSED_ROLES = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}  # fused row blocks, in order
ROLE_ALIASES = {"out": "o"}  # `attn.out_proj` is PEFT's o_proj


class LoraTargetError(ValueError):
    """A `model.lora.targets` pattern that matches no linear of the model."""


@dataclass(frozen=True)
class PeftPiece:
    """The HF module `name` that rows [start, start + size) of a fastlm linear are exported as."""

    name: str
    start: int
    size: int


@dataclass(frozen=True)
class Target:
    """One adaptable slice: of linear `module`, fastlm name `path`, exported into the PEFT modules `peft`."""

    module: str
    slice: Slice
    path: str
    peft: tuple[PeftPiece, ...]

    def matches(self, pattern: str) -> bool:
        """Shell-style, against the end of a dotted name (`attn.q` matches `blocks.0.attn.q`)."""
        if pattern == ALL_LINEAR:
            return True
        return any(
            fnmatchcase(name, pattern) or fnmatchcase(name, f"*.{pattern}") for name in (self.path, *(p.name for p in self.peft))
        )


def _slices(name: str, linear: nn.Linear, parent: nn.Module) -> list[Slice]:
    """A fused projection's role slices (sizes from its module's `split_sizes`, else equal), or one slice."""
    leaf = name.rsplit(".", 1)[-1]
    roles = FUSED_ROLES.get(leaf)
    if roles is None:
        stem = leaf.removesuffix("_proj")
        return [Slice(ROLE_ALIASES.get(stem, stem), 0, linear.out_features)]
    sizes = tuple(getattr(parent, "split_sizes", ())) or (linear.out_features // len(roles),) * len(roles)
    roles = roles[:len(sizes)]  # q and k rows only where the values are the keys (Gemma 4's attention_k_eq_v)
    if len(sizes) != len(roles) or sum(sizes) != linear.out_features:
        raise ValueError(f"{name}: cannot cut {linear.out_features} rows into {roles} of sizes {sizes}")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [Slice(role, start, size) for role, start, size in zip(roles, starts, sizes)]


def _peft_pieces(model: nn.Module) -> dict[str, list[PeftPiece]]:
    """fastlm linear name -> the HF modules its weight's rows are exported as (the family's HF weight table)."""
    from fastlm.models.hf import weight_rules

    pieces: dict[str, list[PeftPiece]] = {}
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    for rule in weight_rules(model.config):
        name = rule.ours.removesuffix(".weight")
        if name in linears and rule.ours.endswith(".weight"):
            sizes = rule.sizes or (linears[name].out_features,)
            pieces[name] = [PeftPiece(theirs.removesuffix(".weight"), sum(sizes[:i]), size)
                            for i, (theirs, size) in enumerate(zip(rule.theirs, sizes))]
    return pieces


def candidate_targets(model: nn.Module) -> list[Target]:
    """Every slice of every nn.Linear of the model (the output matrix is a parameter, not a linear)."""
    modules = dict(model.named_modules())
    pieces = _peft_pieces(model)
    targets = []
    for name, module in modules.items():
        if not isinstance(module, nn.Linear):
            continue
        parent_name = name.rpartition(".")[0]
        for piece in _slices(name, module, modules[parent_name]):
            exported = tuple(p for p in pieces.get(name, [])
                             if p.start < piece.start + piece.size and piece.start < p.start + p.size)
            targets.append(Target(name, piece, f"{parent_name}.{piece.role}" if parent_name else piece.role, exported))
    return targets


def select_targets(model: nn.Module, patterns: list[str]) -> list[Target]:
    """The slices the patterns name; a pattern that names none is a `LoraTargetError` listing what exists."""
    candidates = candidate_targets(model)
    for pattern in patterns:
        if not any(target.matches(pattern) for target in candidates):
            roles = sorted({target.path.split(".", 2)[-1] for target in candidates})
            peft = sorted({p.name.rsplit(".", 1)[-1] for target in candidates for p in target.peft})
            raise LoraTargetError(f"{pattern!r} matches no linear of this model; it has {', '.join(roles)} "
                                  f"(PEFT names {', '.join(peft) or 'none'}), or use {ALL_LINEAR}")
    return [target for target in candidates if any(target.matches(p) for p in patterns)]


def lora_layers(model: nn.Module) -> dict[str, LoraLinear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLinear)}


def base_fingerprint(model: nn.Module) -> str:
    """sha256 of the base weights (names, dtypes, shapes, bytes): a LoRA checkpoint holds it, resume and merge check it."""
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        if ".lora_" in name:
            continue
        value = value.detach().cpu().contiguous()
        digest.update(f"{name}|{value.dtype}|{tuple(value.shape)}\n".encode())
        digest.update(memoryview(value.view(torch.uint8).numpy()))
    return digest.hexdigest()


def attach_lora(model: nn.Module, config: LoraConfig, seed: int = 0, base_dtype: torch.dtype | None = None) -> list[Target]:
    """Freeze the model, put fp32 adapters on the targeted slices (swapping those nn.Linear for `LoraLinear`,
    weights shared; A drawn from `seed` and the module's name, B = 0), unfreeze the adapters (and the untied
    head with `train_head`); linear weights of the frozen base take `base_dtype` (the run's autocast dtype)
    when given. Works on the meta device too."""
    targets = select_targets(model, config.targets)
    model.requires_grad_(False)
    by_module: dict[str, list[Slice]] = {}
    for target in targets:
        by_module.setdefault(target.module, []).append(target.slice)
    for name, slices in by_module.items():
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = LoraLinear(getattr(parent, leaf), slices, config.rank, config.scale, config.dropout)
        digest = hashlib.sha256(f"{seed}:{name}".encode()).hexdigest()  # the run's own RNG stream is untouched
        layer.reset_adapters(config.init, torch.Generator().manual_seed(int(digest[:15], 16)))
        setattr(parent, leaf, layer)
    if config.train_head:
        if getattr(model, "lm_head_weight", None) is None:
            raise ValueError("model.lora.train_head needs an untied output matrix (model.tie_embeddings: false)")
        model.lm_head_weight.requires_grad_(True)
        model.lora_base_head = model.lm_head_weight.detach().clone()  # the base's head, for `BaseView`
    if base_dtype is not None:
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.data = module.weight.data.to(base_dtype)
    return targets


def trainable_names(model: nn.Module) -> list[str]:
    return [name for name, parameter in model.named_parameters() if parameter.requires_grad]


def adapter_mismatches(model: nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
    """Tensors of an adapter state that are no trained tensor of `model`, or have another shape."""
    parameters = dict(model.named_parameters())
    return [f"{name} {tuple(value.shape)}" for name, value in state.items()
            if name not in parameters or not parameters[name].requires_grad or parameters[name].shape != value.shape]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model's forward: every adapter off for the block (torch.compile'd blocks are not used under no_grad)."""
    layers = list(lora_layers(model).values())
    states = [layer.adapters_enabled for layer in layers]
    for layer in layers:
        layer.adapters_enabled = False
    try:
        yield
    finally:
        for layer, state in zip(layers, states):
            layer.adapters_enabled = state


class BaseView:
    """The frozen base under a LoRA model, as a reference model: the same modules with the adapters off, in
    eval mode and without grad (and the base's head with `train_head`): no second copy of the weights."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @property
    def config(self) -> Any:  # the model's config, whatever its family's type
        return self.model.config

    @property
    def output_weight(self) -> torch.Tensor:
        base_head = getattr(self.model, "lora_base_head", None)
        return self.model.output_weight if base_head is None else base_head

    @contextlib.contextmanager
    def _base(self) -> Iterator[None]:
        training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), adapters_disabled(self.model):
                yield
        finally:
            self.model.train(training)

    def hidden_states(self, input_ids: torch.Tensor, document_ids: torch.Tensor | None = None,
                      padding: torch.Tensor | None = None, routed_experts: torch.Tensor | None = None) -> torch.Tensor:
        with self._base():
            return self.model.hidden_states(input_ids, document_ids, padding, routed_experts)

    def head_logits(self, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """The head through this view's output weight (a plain linear: no adapter sits on it)."""
        with torch.no_grad():
            return self.model.head_logits(hidden, self.output_weight if weight is None else weight)

    def logits(self, input_ids: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.head_logits(self.hidden_states(input_ids, document_ids))


class AdapterSnapshot(BaseView):
    """A LoRA model as it was when taken (e.g. the policy at the end of an RL warm-up), as a reference model: a
    frozen copy of its trained tensors only (adapters, and the head with `train_head`), put in place of the
    live ones for each forward of the same modules over the shared frozen base: no second copy of the base.
    `state` (name -> tensor, e.g. read back from a checkpoint) replaces the model's current trained tensors."""

    def __init__(self, model: nn.Module, state: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__(model)
        parameters = dict(model.named_parameters())
        if state is None:
            state = {name: value for name, value in parameters.items() if value.requires_grad}
        self.state = {name: value.detach().to(parameters[name].device, parameters[name].dtype).clone()
                      for name, value in state.items()}

    @property
    def output_weight(self) -> torch.Tensor:
        return self.state.get("lm_head_weight", self.model.output_weight)

    @contextlib.contextmanager
    def _base(self) -> Iterator[None]:
        parameters = dict(self.model.named_parameters())
        live = {name: parameters[name].data for name in self.state}
        training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for name, value in self.state.items():
                    parameters[name].data = value
                yield
        finally:
            for name, value in live.items():
                parameters[name].data = value
            self.model.train(training)


@torch.no_grad()
def merged_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of every base parameter, one at a time, adapted linears as W + scale B A (fp32 sum, in
    the weight's dtype): what the rollout replica and a merged export hold. Without adapters: the parameters."""
    layers = lora_layers(model)
    for name, value in model.named_parameters():
        if ".lora_" in name:
            continue
        value = full_tensor(value)
        layer = layers.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
        yield name, value if layer is None else (value.float() + layer.delta_weight().to(value.device)).to(value.dtype)
