"""Shared helpers for the model tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import yaml

from fastlm.models.config import GPT2Config, LlamaConfig
from fastlm.models.decoder import DecoderLM, build_model
from fastlm.run_config.schema import RunConfig

PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "presets"
TINY_PRESETS = ("tiny-llama", "tiny-gpt2", "qwen2-tiny", "mistral-tiny", "gemma3-tiny")


def load_preset(name: str) -> GPT2Config | LlamaConfig:
    """The model section of a preset file, validated through the root schema like a real run."""
    return RunConfig.model_validate(yaml.safe_load((PRESET_DIR / f"{name}.yaml").read_text())).model


def make_model(config: GPT2Config | LlamaConfig, dtype: torch.dtype = torch.float64, seed: int = 0) -> DecoderLM:
    """A CPU model in eval mode; the init is perturbed so norms and biases are not trivially 1 / 0."""
    torch.manual_seed(seed)
    model = build_model(config, device="cpu").to(dtype).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model


def randomize_weights(model: torch.nn.Module, seed: int, scale: float = 0.1, norms_at_one: bool = True) -> None:
    """Every tensor of a (transformers) model random, so a misplaced one changes the logits: norm weights
    1 + normal(0, 0.1) (around 0 with `norms_at_one` false: Gemma's (1 + w) norms), the rest, biases and
    routers included (transformers zero-initialises some), normal(0, scale)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
            is_norm = parameter.ndim == 1 and ("norm" in name or ".ln_" in name) and name.endswith("weight")
            parameter.copy_(1.0 + 0.1 * noise if is_norm and norms_at_one else scale * noise)


def center_offset_norms(model: torch.nn.Module) -> None:
    """After `randomize_weights`: the (1 + w) RMSNorms of Qwen3.5 / Qwen3-Next (every norm but the linear
    attention's gated one) around 0, as trained checkpoints have them (around 1 each would double the
    activations at every norm, and fp32 rounding with them)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.ndim == 1 and "norm" in name and "linear_attn" not in name:
                parameter.sub_(1.0)


def saved_pretrained(directory_for: Callable[[str], Path], names: Iterable[str],
                     build: Callable[[str], torch.nn.Module]) -> dict[str, tuple[torch.nn.Module, Path]]:
    """Each name's (transformers) model from `build` and the folder `save_pretrained` wrote it to."""
    built = {}
    for name in names:
        model, directory = build(name), directory_for(name)
        model.save_pretrained(directory)
        built[name] = (model, directory)
    return built


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| (detached)."""
    actual, expected = actual.detach(), expected.detach()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def small_llama(**overrides: Any) -> LlamaConfig:
    """A very small Llama config for exactness tests (float64, a few dozen tokens)."""
    values: dict[str, Any] = dict(vocab_size=50, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                  intermediate_size=48, max_seq_len=64)
    values.update(overrides)
    return LlamaConfig(**values)


def small_gpt2(**overrides: Any) -> GPT2Config:
    values: dict[str, Any] = dict(vocab_size=50, hidden_size=32, num_layers=2, num_heads=4, max_seq_len=64)
    values.update(overrides)
    return GPT2Config(**values)
