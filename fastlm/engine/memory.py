"""A run's peak training memory, predicted from its config: what `fastlm validate` prints and holds against
the device before anything is allocated.

The weights and AdamW's moments (fp32, or a frozen LoRA base in the autocast dtype) stay all step. On top of
them the step peaks either where the backward starts, holding every activation still saved, the LM head's
and the first gradients (the output projection's), or where it ends, holding every gradient (they are freed
before each forward); the larger of the two counts. The activations are,
per token: without checkpointing, every layer's saved tensors; with checkpointing, every layer's input (4H
bytes, the fp32 residual stream; none with offload) plus one layer's saved tensors while it is recomputed.
A layer's saved tensors (bytes per token, bf16 autocast, llama-like block of hidden H, q width Dq, kv width
Dkv, feed-forward F): attention ~ 10H + 6Dq + 8Dkv (norm input and output, q/k/v before and after RoPE,
the attention output and its statistics), MLP ~ 6H + 8F (norm input and output, the gate/up projection, the
activation and the product); the tiled MLP keeps 4H of it and one tile's 8F at a time. The LM head holds
the final hidden states, their gradient and one chunk of logits (`model.head.logits_memory_mib`). The dense
attention mask (CPU, or dropout on CUDA) adds B*S^2 bytes. An online RL run also samples: the rollout's KV
cache and the sampler's bf16 replica may be the larger peak (long completions). Checked against measured peaks on a GPU in
docs/benchmarks.md ("Long context").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fastlm.config.errors import ConfigIssue
from fastlm.engine.lora_training import lora_base_dtype
from fastlm.engine.runtime import autocast_dtype
from fastlm.losses.config import DEFAULT_LOGITS_MEMORY_MIB
from fastlm.models import build_model, count_parameters, num_parameters

if TYPE_CHECKING:
    from fastlm.run_config.schema import RunConfig

GIB = 2**30
WORKSPACE = GIB // 4  # cuBLAS and compiled kernels' workspaces (torch's allocated bytes, not the CUDA context)


@dataclass(frozen=True)
class MemoryPrediction:
    parts: dict[str, int]  # bytes per part, in the order they are described

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        detail = ", ".join(f"{name} {size / GIB:.2f}" for name, size in self.parts.items() if size)
        return f"predicted peak training memory {self.total / GIB:.2f} GiB ({detail})"


def predict_training_memory(config: RunConfig, device: torch.device) -> MemoryPrediction:
    """The step's peak on `device` for one micro-batch of `data.micro_batch_size` x `data.seq_len` tokens."""
    model, trainer = config.model, config.trainer
    built = build_model(model, device="meta")
    if model.lora is not None:
        from fastlm.lora.attach import attach_lora

        attach_lora(built, model.lora, base_dtype=lora_base_dtype(config, device))
    trainable = sum(p.numel() for p in built.parameters() if p.requires_grad)
    weights = sum(p.numel() * p.element_size() for p in built.parameters())
    amp = autocast_dtype(trainer, device)
    value = 2 if amp is not None else 4
    rows, seq_len = config.data.micro_batch_size, config.data.seq_len
    tokens = rows * seq_len
    hidden, layers = model.hidden_size, model.num_layers
    q_width = model.num_heads * (model.head_dim or hidden // model.num_heads)
    kv_width = model.kv_heads * (model.head_dim or hidden // model.num_heads)
    ffn = model.ffn_size
    attention = 4 * hidden + value * (3 * hidden + 3 * q_width + 4 * kv_width)
    tile = trainer.mlp_tile_len
    mlp_tokens = min(seq_len, tile) * rows if tile else tokens
    mlp = 4 * hidden * (tokens if tile else 0) + (4 * hidden + value * (hidden + 4 * ffn)) * mlp_tokens
    layer = attention * tokens + mlp
    if trainer.activation_checkpointing:
        kept = 0 if trainer.activation_offload else layers * 4 * hidden * tokens
        activations = kept + layer
    else:
        activations = layers * layer
    casts = value * count_parameters(built) // max(layers, 1) * (2 if trainer.activation_checkpointing else layers)
    head_weight = model.vocab_size * hidden
    budget = DEFAULT_LOGITS_MEMORY_MIB if model.head.logits_memory_mib is None else model.head.logits_memory_mib
    backward_start = {
        "activations": activations,
        "head": min(int(budget * 2**20) or 2**62, tokens * model.vocab_size * (value + 4))
        + 2 * 4 * hidden * tokens
        + (4 * head_weight if built.output_weight.requires_grad else 0),
        "attention mask": rows * seq_len * seq_len if _dense_mask(config, device) else 0,
    }
    parts = {
        "weights": weights,
        "AdamW": 8 * trainable,
        "weight casts": casts if amp is not None and model.lora is None else 0,
        "workspace": WORKSPACE if device.type == "cuda" else 0,
    }
    peaks = [backward_start, {"grads": 4 * trainable}, _rollout(config, device, kv_width, value)]
    return MemoryPrediction({**parts, **max(peaks, key=lambda peak: sum(peak.values()))})


def _rollout(config: RunConfig, device: torch.device, kv_width: int, value: int) -> dict[str, int]:
    """An online RL run's sampling: every row of the rollout (prompts x group) with a KV cache as long as a
    training row (prompt + completion), and on CUDA the sampler's bf16 replica of the weights."""
    rl, model = config.rl, config.model
    if rl is None:
        return {}
    rows = rl.prompts_per_rollout * rl.group_size
    span = min(model.max_seq_len, config.data.seq_len + 1)
    replica = 2 * num_parameters(model) if device.type == "cuda" and rl.cuda_graph else 0
    return {"KV cache": rows * span * model.num_layers * 2 * kv_width * value, "sampling replica": replica}


def _dense_mask(config: RunConfig, device: torch.device) -> bool:
    """Whether the packed rows attend through the dense (B, 1, S, S) mask: on the CPU, or with attention dropout."""
    return device.type != "cuda" or config.model.dropout > 0


def memory_issues(config: RunConfig, prediction: MemoryPrediction) -> list[ConfigIssue]:
    """The prediction held against the run's device (`device_memory`): refused, with the numbers, when over."""
    device = device_memory(config)
    if device is None or prediction.total <= device[0]:
        return []
    return [ConfigIssue("data.seq_len", f"the step does not fit {device[1]} ({device[0] / GIB:.1f} GiB): "
                        f"{prediction.describe()}", config.data.seq_len,
                        hint="turn on trainer.activation_checkpointing (then trainer.activation_offload, "
                        "trainer.mlp_tile_len), use model.lora, or lower data.micro_batch_size or data.seq_len")]


def device_memory(config: RunConfig) -> tuple[int, str] | None:
    """The memory the run's device has and its name, where the run names one: the CUDA card it would use, or
    this machine's RAM for `trainer.device: cpu`; None for `auto` on a machine without CUDA (a config checked
    on a laptop for a GPU run is not refused for the laptop's memory)."""
    if config.trainer.device != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name(0)
    if config.trainer.device == "cpu":
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"
    return None
