"""The MoE layer's speed: fastlm's grouped-GEMM experts against its per-expert loop and transformers' own
sparse MoE block (Qwen3-MoE's, eager experts and its `grouped_mm` experts) on the same weights,
forward + backward, bf16; and whole models: an MoE preset against a dense model of equal active size,
tokens/s and MFU counted on active parameters (tools/bench_train.py's loop).

    python tools/bench_moe.py                        # CUDA: layer shapes (16-64 experts, top-2..8, hidden 1024-2048)
    python tools/bench_moe.py --models olmoe-1b-7b --num-layers 4 --batch 4 --seq-len 2048
                                                      # + whole models: the preset on grouped GEMMs, on the
                                                      #   loop, and its dense twin (equal active size)
    python tools/bench_moe.py --cpu-smoke --models mixtral-tiny   # CPU: tiny shapes, float32 (CI smoke test)

Each layer row also prints the grouped path's largest error against the loop (relative to the output's
largest value, and the same for the input gradient), the GPU check of the two paths within bf16 tolerance.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastlm.layers.moe import MoEMLP  # noqa: E402 - after the repository joins the path


@dataclass(frozen=True)
class LayerShape:
    experts: int
    top_k: int
    hidden: int
    ffn: int
    tokens: int

    def __str__(self) -> str:
        return f"E{self.experts} k{self.top_k} H{self.hidden} F{self.ffn} T{self.tokens}"


GPU_SHAPES = [
    LayerShape(16, 2, 1024, 2816, 16384),  # Mixtral-like, scaled
    LayerShape(64, 8, 2048, 1024, 16384),  # OLMoE-1B-7B's layer
    LayerShape(128, 8, 2048, 768, 16384),  # Qwen3-30B-A3B's layer
    LayerShape(32, 4, 1024, 512, 16384),
]
CPU_SHAPES = [LayerShape(8, 2, 32, 16, 64)]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_ms(run, device: torch.device, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        run()
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    _synchronize(device)
    return (time.perf_counter() - start) / repeats * 1e3


def transformers_block(shape: LayerShape, experts_implementation: str | None, ours: MoEMLP) -> torch.nn.Module:
    """Qwen3-MoE's block (renormalised top-k) holding `ours`' weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=shape.hidden, moe_intermediate_size=shape.ffn, num_experts=shape.experts,
                            num_experts_per_tok=shape.top_k, norm_topk_prob=True)
    config._experts_implementation = experts_implementation
    block = Qwen3MoeSparseMoeBlock(config).to(device=ours.down_proj.device, dtype=ours.down_proj.dtype)
    with torch.no_grad():
        block.gate.weight.copy_(ours.router.weight)
        gate_up, down = ours.expert_weights()
        block.experts.gate_up_proj.copy_(gate_up)
        block.experts.down_proj.copy_(down)
    return block


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def bench_layer(shape: LayerShape, device: torch.device, dtype: torch.dtype, repeats: int, warmup: int) -> list[str]:
    torch.manual_seed(0)
    layer = MoEMLP(shape.hidden, shape.ffn, shape.experts, shape.top_k, True).to(device=device, dtype=dtype)
    layer.reset_parameters(0.02, 0.02)
    x = torch.randn(shape.tokens, shape.hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)

    def fwd_bwd(module: torch.nn.Module):
        def run() -> tuple[torch.Tensor, torch.Tensor]:
            x.grad = None
            out = module(x.unsqueeze(0)).squeeze(0)
            out.backward(grad)
            return out.detach(), x.grad

        return run

    results = {}
    times = {}
    for backend in ("grouped", "loop"):
        layer.backend = backend
        results[backend] = fwd_bwd(layer)()
        times[f"fastlm {backend}"] = time_ms(fwd_bwd(layer), device, repeats, warmup)
    for implementation in (None, "grouped_mm") if device.type == "cuda" else (None,):
        name = f"transformers {implementation or 'eager'}"
        try:
            block = transformers_block(shape, implementation, layer)
            times[name] = time_ms(fwd_bwd(block), device, repeats, warmup)
        except Exception as error:  # noqa: BLE001 - a peer the installed transformers cannot run here
            print(f"{shape}: {name} did not run ({type(error).__name__}: {str(error)[:120]})")
    error_out = _max_rel(results["grouped"][0], results["loop"][0])
    error_dx = _max_rel(results["grouped"][1], results["loop"][1])
    reference = times.get("transformers eager")
    rows = []
    for name, ms in times.items():
        speedup = f"{reference / ms:.2f}x" if reference else "-"
        rows.append(f"| {shape} | {name} | {ms:.2f} | {speedup} | {error_out:.1e} / {error_dx:.1e} |")
    return rows


def dense_twin(config: Any) -> Any:
    """A Llama of the MoE model's attention shape whose SwiGLU MLP is top_k experts wide: the same active
    parameters per token but the router's (and OLMoE's q/k norms)."""
    from fastlm.models.llama.config import LlamaConfig

    fields = {"vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "max_seq_len",
              "tie_embeddings", "rope_theta", "norm_eps", "head"}
    return LlamaConfig.model_validate({**config.model_dump(include=fields),
                                       "intermediate_size": config.moe.top_k * config.moe.ffn_size})


@dataclass
class ModelRow:
    name: str
    parameters: int
    active: int
    tokens_per_second: float
    mfu: float
    peak_memory_gib: float


def time_model(name: str, config: Any, batch: int, seq_len: int, steps: int, device: torch.device, peak: float) -> ModelRow:
    """tools/bench_train.py's step (bf16 autocast on CUDA, the chunked head's CE + z-loss, fused AdamW) on
    synthetic rows; MFU on the active parameters' FLOPs (`model_flops_per_token`)."""
    from bench_train import synthetic_batches

    from fastlm.engine.optim import build_optimizer
    from fastlm.losses.spec import LossNormalizers, LossTargets
    from fastlm.models import (
        active_parameters,
        build_model,
        model_flops_per_token,
        num_parameters,
    )
    from fastlm.run_config.schema import RunConfig
    from fastlm.system.device import autocast

    run = RunConfig.model_validate({"model": config.model_dump()})
    torch.manual_seed(0)
    model = build_model(run.model, device=device).train()
    optimizer = build_optimizer(model, run.optimizer)
    amp = torch.bfloat16 if device.type == "cuda" else None
    batches = synthetic_batches(config.vocab_size, batch, seq_len, False, device)

    def step(index: int) -> None:
        rows = batches[index % len(batches)]
        with autocast(device, amp):
            result = model(rows.input_ids, LossTargets(labels=rows.labels),
                           LossNormalizers(tokens=rows.tokens, positions=float(rows.input_ids.numel())))
        result.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ms = time_ms(lambda: step(0), device, steps, 2)
    tokens_per_second = batch * seq_len / (ms / 1e3)
    mfu = model_flops_per_token(run.model, seq_len) * tokens_per_second / peak
    memory = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    return ModelRow(name, num_parameters(run.model), active_parameters(run.model), tokens_per_second, mfu, memory)


def bench_models(presets: list[str], batch: int, seq_len: int, steps: int, device: torch.device,
                 num_layers: int | None = None) -> list[str]:
    """Each MoE preset on grouped GEMMs and on the loop, and its dense twin, in one run; `num_layers`
    shortens the presets (OLMoE-1B-7B whole needs ~110 GB for fp32 weights, gradients and AdamW)."""
    import yaml
    from bench_train import measured_peak_flops

    from fastlm.run_config.schema import RunConfig

    peak = measured_peak_flops(device)
    lines = [f"matmul peak {peak / 1e12:.1f} TFLOP/s; batch {batch} x seq {seq_len}",
             "| model | params | active | tokens/s | MFU (active) | peak mem GiB | MFU / dense twin's |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for preset in presets:
        document = yaml.safe_load((ROOT / "configs" / "presets" / f"{preset}.yaml").read_text())
        if num_layers:
            document["model"]["num_layers"] = num_layers
        config = RunConfig.model_validate(document).model
        grouped, loop = (config.model_copy(update={"moe": config.moe.model_copy(update={"backend": backend})})
                         for backend in ("grouped", "loop"))
        rows = [time_model(f"{preset} dense twin", dense_twin(config), batch, seq_len, steps, device, peak),
                time_model(f"{preset} grouped", grouped, batch, seq_len, steps, device, peak),
                time_model(f"{preset} loop", loop, batch, seq_len, steps, device, peak)]
        if device.type == "cuda":
            torch.cuda.empty_cache()
        for row in rows:
            lines.append(f"| {row.name} | {row.parameters / 1e6:.1f}M | {row.active / 1e6:.1f}M | "
                         f"{row.tokens_per_second:,.0f} | {row.mfu:.1%} | {row.peak_memory_gib:.1f} | "
                         f"{row.mfu / rows[0].mfu:.2f} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, float32")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--models", nargs="*", default=[], help="MoE presets to time whole (with their dense twins)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--num-layers", type=int, default=None, help="--models: override the presets' layer count")
    args = parser.parse_args()
    device = torch.device("cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda")
    if args.cpu_smoke:
        torch.set_num_threads(1)  # tiny shapes: a second thread only waits at the barriers of a busy machine
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    shapes = CPU_SHAPES if device.type == "cpu" else GPU_SHAPES
    repeats, warmup = (2, 1) if args.cpu_smoke else (args.repeats, 3)
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; torch {torch.__version__}; {dtype}")
    print("| shape | implementation | fwd+bwd ms | vs transformers eager | grouped vs loop: out / dx max rel err |")
    print("| --- | --- | --- | --- | --- |")
    for shape in shapes:
        for row in bench_layer(shape, device, dtype, repeats, warmup):
            print(row)
    if args.models:
        batch, seq_len, steps = (2, 32, 1) if args.cpu_smoke else (args.batch, args.seq_len, args.steps)
        for line in bench_models(args.models, batch, seq_len, steps, device, args.num_layers):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
