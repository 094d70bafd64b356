"""LoRA memory and speed (`tools/bench_train.py --lora`): in one run, per preset and sequence length,

    full   full fine-tune: fp32 weights, bf16 autocast, fused AdamW on every parameter (bench_train's loop)
    lora   LoRA rank r on every linear (`model.lora`): the frozen base's linears in bf16, fp32 adapters, AdamW on them
    lora+ac  the same with activation checkpointing
    peft   HF PEFT's LoRA (same rank, alpha, all linears) on transformers' model: bf16 weights, SDPA, bf16
           autocast, fused AdamW on the adapters

peak memory (torch.cuda.max_memory_allocated) and tokens/s, plus the issue's two ratios: LoRA peak memory
over full fine-tuning's (goal <= 0.40 at 1B) and LoRA tokens/s over PEFT's (goal >= 1.5). Blocks are compiled
on CUDA as `fastlm train` compiles them (trainer.compile: auto); `--cpu-smoke` runs the tiny preset for two
steps in fp32 (CI).

    python tools/bench_train.py --lora --presets llama-1b --batch 4 --seq-len 2048 4096 8192
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from train_loops import Loop, StepBatch, synthetic_batches, time_steps

from fastlm.data.tokenizer import ByteTokenizer
from fastlm.engine.optim import build_optimizer
from fastlm.lora.attach import attach_lora
from fastlm.models.hf import config_to_hf
from fastlm.models.lora_config import LoraConfig


@dataclass
class LoraRow:
    preset: str
    setup: str
    seq_len: int
    batch: int
    trainable: int
    total: int
    peak_memory_gib: float
    tokens_per_second: float


class LoraLoop(Loop):
    """bench_train's step (bf16 autocast forward with the fused loss, backward, fused AdamW) on a model with
    adapters: the base linears in the autocast dtype, as the trainer freezes them (fastlm/engine/lora_training.py)."""

    def __init__(self, preset: str, device: torch.device, lora: LoraConfig, activation_checkpointing: bool) -> None:
        super().__init__(preset, _loss(device), "plain", device)
        attach_lora(self.model, lora, base_dtype=self.amp)
        self.model.set_activation_checkpointing(activation_checkpointing)
        if device.type == "cuda":
            self.model.compile_blocks()
        self.optimizer = build_optimizer(self.model, self.config.optimizer)


class PeftLoop:
    """The same step in HF: transformers' model in the autocast dtype with SDPA, PEFT LoRA on all linears, its
    own loss (labels in the batch), fused AdamW on the adapters."""

    def __init__(self, preset: str, device: torch.device, lora: LoraConfig) -> None:
        import peft
        import transformers

        config = Loop(preset, "compiled", "plain", torch.device("meta")).config.model
        fields = config_to_hf(config, ByteTokenizer())
        hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        self.amp = torch.bfloat16 if device.type == "cuda" else None
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=self.amp or torch.float32,
                                                              attn_implementation="sdpa").to(device)
        settings = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules="all-linear",
                                   use_rslora=lora.rslora, task_type="CAUSAL_LM")
        self.model = peft.get_peft_model(model, settings)
        self.device = device
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=1e-4, fused=device.type in ("cuda", "cpu"))

    def step(self, batch: StepBatch) -> None:
        labels = batch.labels.view(batch.input_ids.shape)
        with torch.autocast(self.device.type, dtype=self.amp, enabled=self.amp is not None):
            loss = self.model(input_ids=batch.input_ids, labels=torch.nn.functional.pad(labels, (1, 0), value=-100)[:, :-1]).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _time(loop, batches: list[StepBatch], steps: int, warmup: int, device: torch.device) -> tuple[float, float]:
    """(peak GiB, tokens/s) of `steps` steps after `warmup` (bench_train's timing, from an emptied cache)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    seconds, peak = time_steps(loop, batches, steps, warmup, device)
    rows, seq_len = batches[0].input_ids.shape
    return peak, rows * seq_len / seconds


def _loss(device: torch.device) -> str:
    return "triton" if device.type == "cuda" else "compiled"


def build(setup: str, preset: str, device: torch.device, lora: LoraConfig):
    if setup == "full":
        return Loop(preset, _loss(device), "compile" if device.type == "cuda" else "plain", device)
    if setup == "peft":
        return PeftLoop(preset, device, lora)
    return LoraLoop(preset, device, lora, activation_checkpointing=setup == "lora+ac")


def lora_main(args: argparse.Namespace) -> int:
    smoke = args.cpu_smoke
    device = torch.device("cpu" if smoke else "cuda")
    presets, batches = (["tiny-llama"], [2]) if smoke else (args.presets, args.batch)
    seq_lens = [32] if smoke else args.lora_seq_len
    steps, warmup = (2, 1) if smoke else (args.steps, 3)
    lora = LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank, targets=["all-linear"])
    rows: list[LoraRow] = []
    for preset, batch in zip(presets, batches * len(presets)):
        for seq_len in seq_lens:
            for setup in ("full", "lora", "lora+ac", "peft"):
                loop = build(setup, preset, device, lora)
                data = synthetic_batches(loop.model.config.vocab_size, batch, seq_len, False, device)
                try:
                    peak, speed = _time(loop, data, steps, warmup, device)
                except torch.OutOfMemoryError:
                    peak, speed = float("nan"), 0.0
                parameters = list(loop.model.parameters())
                rows.append(LoraRow(preset, setup, seq_len, batch, sum(p.numel() for p in parameters if p.requires_grad),
                                    sum(p.numel() for p in parameters), peak, speed))
                print(rows[-1], flush=True)
                del loop, data
    print(lora_table(rows, torch.cuda.get_device_name() if device.type == "cuda" else "cpu"))
    return 0


def lora_table(rows: list[LoraRow], device_name: str) -> str:
    lines = [f"LoRA rank r, all linears, on {device_name}",
             "| preset | seq | batch | setup | trainable | peak GiB | tokens/s | memory / full | tokens/s / peft |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        group = [r for r in rows if (r.preset, r.seq_len, r.batch) == (row.preset, row.seq_len, row.batch)]
        full = next(r for r in group if r.setup == "full")
        peft = next(r for r in group if r.setup == "peft")
        memory = f"{row.peak_memory_gib / full.peak_memory_gib:.2f}" if full.peak_memory_gib > 0 else "-"
        speed = f"{row.tokens_per_second / peft.tokens_per_second:.2f}" if peft.tokens_per_second > 0 else "-"
        lines.append(f"| {row.preset} | {row.seq_len} | {row.batch} | {row.setup} | {row.trainable:,} | "
                     f"{row.peak_memory_gib:.2f} | {row.tokens_per_second:,.0f} | {memory} | {speed} |")
    lines.append("goals (1B): lora memory / full <= 0.40; lora tokens/s / peft >= 1.5")
    return "\n".join(lines)
