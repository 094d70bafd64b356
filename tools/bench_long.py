"""Long-context training steps on one card: tokens/s, MFU, peak memory measured beside `fastlm validate`'s
prediction, with and without the memory savers, and transformers + Liger with gradient checkpointing on the
same weights where it fits (run through `tools/bench_train.py --long`).

    python tools/bench_train.py --long --hf                       # CUDA: the tables of docs/benchmarks.md
    python tools/bench_train.py --long --presets qwen3-1.7b --long-seq-len 32768 65536 131072
    python tools/bench_train.py --long --cpu-smoke                # CPU: tiny preset, every setup, two steps

Rows are one document of `seq_len` tokens each (SDPA causal on both sides: equal work, MFU over the whole row).
Full fine-tunes run compiled blocks with activation checkpointing (`ac`), then with the block inputs offloaded
(`trainer.activation_offload`), the MLP tiled (`trainer.mlp_tile_len`) and both; the 8B rows are LoRA (rank 16
on every linear, the base in bf16). A setup that runs out of memory is a row that says so: the longest length
each setup fits is the last one it ran.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from bench_lora import LoraLoop
from train_loops import TILE_LEN, HFLoop, Loop, measured_peak_flops, parse_variant, synthetic_batches, time_steps

from fastlm.engine.memory import GIB, predict_training_memory
from fastlm.models import build_model, model_flops_per_token
from fastlm.models.lora_config import LoraConfig
from fastlm.run_config.schema import RunConfig

FULL_SETUPS = ("compile+ac", "compile+ac+offload", "compile+ac+tiles", "compile+ac+offload+tiles")
LORA_SETUPS = ("lora+ac", "lora+ac+offload", "lora+ac+offload+tiles")
LORA = LoraConfig(rank=16, alpha=32)


@dataclass
class LongRow:
    preset: str
    setup: str
    seq_len: int
    tokens_per_second: float
    mfu: float
    peak_gib: float
    predicted_gib: float
    note: str = ""


def predicted(config: RunConfig, setup: str, seq_len: int, device: torch.device) -> float:
    """`fastlm validate`'s prediction for the setup's trainer settings at one row of `seq_len`."""
    parts = parse_variant(setup.replace("lora+", ""))
    trainer = config.trainer.model_copy(update={"activation_checkpointing": "ac" in parts, "activation_offload":
                                                "offload" in parts, "mlp_tile_len": TILE_LEN if "tiles" in parts else 0})
    model = config.model.model_copy(update={"lora": LORA if setup.startswith("lora") else None, "max_seq_len": seq_len})
    data = config.data.model_copy(update={"seq_len": seq_len, "micro_batch_size": 1})
    run = config.model_copy(update={"trainer": trainer, "model": model, "data": data})
    return predict_training_memory(run, device).total / GIB


def lora_loop(preset: str, setup: str, device: torch.device) -> LoraLoop:
    parts = parse_variant(setup.replace("lora+", ""))
    loop = LoraLoop(preset, device, LORA, activation_checkpointing=True)
    loop.model.set_memory_savers(True, "offload" in parts, TILE_LEN if "tiles" in parts else 0)
    return loop


def run_row(preset: str, setup: str, seq_len: int, steps: int, device: torch.device, peak: float) -> LongRow:
    """One setup at one length; out of memory is a result, not an error."""
    try:
        loop = lora_loop(preset, setup, device) if setup.startswith("lora") else Loop(preset, "triton" if device.type ==
                                                                                          "cuda" else "compiled", setup, device)
        config = loop.config
        prediction = predicted(config, setup, seq_len, device)
        batches = synthetic_batches(config.model.vocab_size, 1, seq_len, False, device)
        seconds, memory = time_steps(loop, batches, steps, 1, device)
        tokens = seq_len / seconds
        mfu = model_flops_per_token(config.model, seq_len) * tokens / peak
        row = LongRow(preset, setup, seq_len, tokens, mfu, memory, prediction)
    except torch.OutOfMemoryError:
        row = LongRow(preset, setup, seq_len, 0.0, 0.0, float("nan"), float("nan"), "out of memory")
    loop = batches = None  # noqa: F841 - free before the next row
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def hf_row(preset: str, seq_len: int, steps: int, device: torch.device, peak: float) -> LongRow:
    """transformers' own class (+ Liger's fused linear cross-entropy when installed) with non-reentrant gradient
    checkpointing and compiled layers, on fastlm's initial weights (bench_train's HFLoop)."""
    config = Loop(preset, "compiled", "plain", torch.device("meta")).config
    try:
        torch.manual_seed(0)
        weights = build_model(config.model, device="meta").to_empty(device="cpu")
        weights.init_weights()
        loop = HFLoop(weights, "compile+ac", device)
        batches = synthetic_batches(config.model.vocab_size, 1, seq_len, False, device)
        seconds, memory = time_steps(loop, batches, steps, 1, device)
        tokens = seq_len / seconds
        row = LongRow(preset, f"{loop.loss_name} +ac", seq_len, tokens,
                      model_flops_per_token(config.model, seq_len) * tokens / peak, memory, float("nan"))
    except torch.OutOfMemoryError:
        row = LongRow(preset, "transformers +ac", seq_len, 0.0, 0.0, float("nan"), float("nan"), "out of memory")
    loop = batches = weights = None  # noqa: F841
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def long_main(args: argparse.Namespace) -> int:
    if args.cpu_smoke:
        device, plan, lengths, steps = torch.device("cpu"), {"tiny-llama": FULL_SETUPS + LORA_SETUPS}, [64], 2
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA device; use --cpu-smoke on CPU")
            return 2
        presets = args.presets if args.presets != ["llama-350m", "llama-1b"] else ["qwen3-1.7b", "qwen3-8b"]
        device, lengths, steps = torch.device("cuda"), args.long_seq_len, args.long_steps
        plan = {preset: tuple(s for s in args.long_setups or (LORA_SETUPS + FULL_SETUPS)
                              if s.startswith("lora") == preset.endswith("8b")) for preset in presets}
    peak = measured_peak_flops(device)
    rows: list[LongRow] = []
    hf_rows = []
    for preset, setups in plan.items():
        for seq_len in lengths:
            for setup in setups:
                rows.append(run_row(preset, setup, seq_len, steps, device, peak))
                print(rows[-1], flush=True)
            if args.hf and not preset.endswith("8b"):
                hf_rows.append(hf_row(preset, seq_len, steps, device, peak))
                print(hf_rows[-1], flush=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}; measured matmul peak {peak / 1e12:.1f} TFLOP/s")
    print("| preset | setup | seq | tokens/s | MFU | peak GiB | predicted GiB | predicted/peak |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows + hf_rows:
        ratio = r.predicted_gib / r.peak_gib if r.peak_gib > 0 else float("nan")
        print(f"| {r.preset} | {r.setup} | {r.seq_len} | {r.tokens_per_second:,.0f} | {r.mfu:.1%} | {r.peak_gib:.1f} | "
              f"{r.predicted_gib:.1f} | {ratio:.2f} | {r.note}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_long.json").write_text(
            json.dumps({"fastlm": [asdict(r) for r in rows], "transformers": [asdict(r) for r in hf_rows]}, indent=1))
    return 0
