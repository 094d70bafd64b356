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

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fastlm.config.errors import ConfigIssue
from fastlm.engine.lora_training import lora_base_dtype
from fastlm.engine.runtime import autocast_dtype
from fastlm.losses.config import DEFAULT_LOGITS_MEMORY_MIB
from fastlm.models import build_model, count_parameters, num_parameters
from fastlm.models.build import describe_count
from fastlm.models.hf import available_memory

if TYPE_CHECKING:
    from fastlm.run_config.schema import RunConfig

GIB = 2**30
WORKSPACE = GIB // 4  # cuBLAS and compiled kernels' workspaces (torch's allocated bytes, not the CUDA context)


@dataclass(frozen=True)
class MemoryPrediction:
    parts: dict[str, int]  # bytes per part, in the order they are described
    state: int  # the floor: weights, their gradients and AdamW's moments (what FSDP shards)

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
    return MemoryPrediction({**parts, **max(peaks, key=lambda peak: sum(peak.values()))}, weights + 12 * trainable)


def _rollout(config: RunConfig, device: torch.device, kv_width: int, value: int) -> dict[str, int]:
    """An online RL run's sampling: every row of the rollout (prompts x group) with a KV cache as long as a
    training row (prompt + completion), and on CUDA the sampler's bf16 replica of the weights."""
    rl, model = config.rl, config.model
    if rl is None:
        return {}
    rows = rl.prompts_per_rollout * rl.group_size
    span = min(model.max_seq_len, config.data.seq_len + 1)
    copies = rl.backend.type == "transformers" or getattr(rl.backend, "cuda_graph", False)  # a bf16 replica
    replica = 2 * num_parameters(model) if device.type == "cuda" and copies else 0
    return {"KV cache": rows * span * model.num_layers * 2 * kv_width * value, "sampling replica": replica}


def _dense_mask(config: RunConfig, device: torch.device) -> bool:
    """Whether the packed rows attend through the dense (B, 1, S, S) mask: on the CPU, or with attention dropout."""
    return device.type != "cuda" or config.model.dropout > 0


def memory_issues(config: RunConfig) -> list[ConfigIssue]:
    """A run that cannot fit where it would train, refused with the numbers before anything is allocated. On a
    GPU the whole predicted peak must fit the card; on the CPU the model state (weights, gradients, AdamW: a
    floor, activations not counted) must fit the memory this host has free, shared by its LOCAL_WORLD_SIZE
    processes (a GPU config checked on a laptop is refused only for what could not even load). FSDP and tensor
    parallelism hold a 1/world share of the state (the process group's world, else WORLD_SIZE: `train
    --nproc-per-node` sets both for its launcher's checks)."""
    on_gpu = torch.cuda.is_available() and config.trainer.device != "cpu"
    prediction = predict_training_memory(config, torch.device("cuda" if on_gpu else "cpu"))
    grouped = torch.distributed.is_available() and torch.distributed.is_initialized()
    sharded = config.distributed.data_parallel == "fsdp" or config.distributed.tensor_parallel > 1
    world = torch.distributed.get_world_size() if grouped else int(os.environ.get("WORLD_SIZE", "1") or 1)
    state = prediction.state // (world if sharded else 1)
    hint = ("shrink the model (num_layers, hidden_size, moe.num_experts, vocab_size), train adapters only (model.lora), "
            "or shard it (distributed.data_parallel: fsdp over more GPUs)")
    if on_gpu:
        needed = state + prediction.total - prediction.state
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        available = torch.cuda.get_device_properties(local_rank).total_memory
        if needed <= available:
            return []
        return [ConfigIssue("model", f"the step needs an estimated {needed / GIB:,.1f} GiB ({prediction.describe()}), "
                            f"but GPU {local_rank} ({torch.cuda.get_device_name(local_rank)}) holds only "
                            f"{available / GIB:,.1f} GiB", hint="turn on trainer.activation_checkpointing (then "
                            "trainer.activation_offload, trainer.mlp_tile_len), lower data.micro_batch_size or data.seq_len; "
                            f"or {hint}")]
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    needed, available = state * processes, available_memory()
    if needed <= available:
        return []
    where = "this host has free" + (f" for its {processes} processes" if processes > 1 else "")
    return [ConfigIssue("model", f"{describe_count(num_parameters(config.model))} parameters need an estimated "
                        f"{needed / GIB:,.1f} GiB to train (parameters + gradients + AdamW, activations not counted), "
                        f"but {where} only {available / GIB:,.1f} GiB", hint=hint)]
