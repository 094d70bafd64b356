"""Training throughput and MFU of the model presets, Triton loss against the compiled loss, in one run.

    python tools/bench_train.py                      # CUDA: llama-350m and llama-1b, seq 2048, bf16
    python tools/bench_train.py --cpu-smoke          # CPU: the tiny preset, two steps (CI smoke test)

MFU = model_flops_per_token(config, seq_len) * tokens/s / peak, with the peak measured in the same
run as an 8192^3 bf16 matmul (so the ratio does not depend on a datasheet number).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastlm.config.schema import RunConfig  # noqa: E402 - after the path fix
from fastlm.engine.optim import build_optimizer  # noqa: E402
from fastlm.engine.runtime import autocast  # noqa: E402
from fastlm.losses.spec import LossNormalizers, LossTargets  # noqa: E402
from fastlm.models import build_model, count_parameters, model_flops_per_token  # noqa: E402


@dataclass
class Row:
    preset: str
    loss: str
    compiled_model: bool
    parameters: int
    batch: int
    seq_len: int
    step_ms: float
    tokens_per_second: float
    mfu: float
    peak_memory_gib: float


def model_config(preset: str, loss: str, vocab_override: int | None) -> RunConfig:
    data = yaml.safe_load((ROOT / "configs" / "presets" / f"{preset}.yaml").read_text())
    model = data["model"]
    model["head"] = {"use_triton": loss == "triton", "losses": {"cross_entropy": {}, "z_loss": {"weight": 1e-4}}}
    if vocab_override:
        model["vocab_size"] = vocab_override
    return RunConfig.model_validate({"model": model})


def measured_peak_flops(device: torch.device) -> float:
    """bf16 matmul rate on this device (CUDA), or float32 on CPU; FLOP/s."""
    size = 8192 if device.type == "cuda" else 512
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    repeats = 20 if device.type == "cuda" else 3
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _synchronize(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench(preset: str, loss: str, compile_model: bool, batch: int, seq_len: int, steps: int, warmup: int,
          device: torch.device, peak: float, vocab_override: int | None = None) -> Row:
    config = model_config(preset, loss, vocab_override)
    torch.manual_seed(0)
    model = build_model(config.model, device=device)
    optimizer = build_optimizer(model, config.optimizer)
    amp = torch.bfloat16 if device.type == "cuda" else None
    forward = torch.compile(model) if compile_model else model
    vocab = config.model.vocab_size
    inputs = [torch.randint(0, vocab, (batch, seq_len + 1), device=device) for _ in range(2)]
    normalizers = LossNormalizers(tokens=float(batch * seq_len))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def step(index: int) -> None:
        tokens = inputs[index % len(inputs)]
        with autocast(device, amp):
            result = forward(tokens[:, :-1], LossTargets(labels=tokens[:, 1:].reshape(-1)), normalizers)
        result.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for index in range(warmup):
        step(index)
    _synchronize(device)
    start = time.perf_counter()
    for index in range(steps):
        step(index)
    _synchronize(device)
    seconds = (time.perf_counter() - start) / steps
    tokens_per_second = batch * seq_len / seconds
    mfu = model_flops_per_token(config.model, seq_len) * tokens_per_second / peak
    memory = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    row = Row(preset, loss, compile_model, count_parameters(model), batch, seq_len, seconds * 1e3,
              tokens_per_second, mfu, memory)
    del model, optimizer, forward, inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def table(rows: list[Row], peak: float, device_name: str) -> str:
    lines = [
        f"device: {device_name}; measured matmul peak {peak / 1e12:.1f} TFLOP/s; torch {torch.__version__}",
        "| preset | loss | torch.compile model | params | batch x seq | step ms | tokens/s | MFU | peak mem GiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.preset} | {r.loss} | {r.compiled_model} | {r.parameters / 1e6:.0f}M | {r.batch}x{r.seq_len} "
            f"| {r.step_ms:.1f} | {r.tokens_per_second:,.0f} | {r.mfu:.1%} | {r.peak_memory_gib:.1f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny preset on CPU, two steps")
    parser.add_argument("--presets", nargs="+", default=["llama-350m", "llama-1b"])
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 4], help="micro-batch per preset")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compile-model", action="store_true", help="also time torch.compile'd models")
    args = parser.parse_args()
    if args.cpu_smoke:
        device, presets, batches, seq_len, steps, warmup, losses = (
            torch.device("cpu"), ["tiny-llama"], [2], 32, 2, 1, ["compiled"])
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA device; use --cpu-smoke on CPU", file=sys.stderr)
            return 2
        device, presets, batches, seq_len, steps, warmup, losses = (
            torch.device("cuda"), args.presets, args.batch, args.seq_len, args.steps, 3, ["triton", "compiled"])
    peak = measured_peak_flops(device)
    rows = []
    for preset, batch in zip(presets, batches * len(presets)):
        for loss in losses:
            for compiled in [False, True] if args.compile_model else [False]:
                rows.append(bench(preset, loss, compiled, batch, seq_len, steps, warmup, device, peak))
                print(f"{rows[-1]}", flush=True)
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(table(rows, peak, device_name))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_train.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
