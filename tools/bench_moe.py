"""The MoE layer's speed: fastlm's grouped-GEMM experts against its per-expert loop and transformers' own
sparse MoE block (Qwen3-MoE's, eager experts and its `grouped_mm` experts) on the same weights,
forward + backward, bf16; and whole models: an MoE preset against a dense model of equal active size,
tokens/s and MFU counted on active parameters (tools/bench_train.py's loop).

    python tools/bench_moe.py                        # CUDA: layer shapes (16-64 experts, top-2..8, hidden 1024-2048)
    python tools/bench_moe.py --models qwen3-moe-tiny # + whole-model rows (MoE preset and its dense twin)
    python tools/bench_moe.py --cpu-smoke             # CPU: tiny shapes, float32, a few repeats (CI smoke test)

Each layer row also prints the grouped path's largest error against the loop (relative to the output's
largest value, and the same for the input gradient), the GPU check of the two paths within bf16 tolerance.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastlm.layers.moe import MoEMLP


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
    for implementation in (None, "grouped_mm"):
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


def bench_models(presets: list[str], batch: int, seq_len: int, steps: int, device: torch.device) -> list[str]:
    """Each MoE preset and its dense twin (same attention, one SwiGLU MLP of the active experts' width):
    tools/bench_train.py's step, MFU on active parameters."""
    from bench_train import bench, measured_peak_flops, table

    from fastlm.models.moe_family import dense_twin_config

    peak = measured_peak_flops(device)
    rows = []
    for preset in presets:
        rows.append(bench(preset, "compiled", "plain", batch, seq_len, steps, 2, device, peak))
        rows.append(bench(preset, "compiled", "plain", batch, seq_len, steps, 2, device, peak,
                          model_override=dense_twin_config(preset)))
    return table(rows, peak, torch.cuda.get_device_name() if device.type == "cuda" else "cpu").splitlines()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, float32")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--models", nargs="*", default=[], help="MoE presets to time whole (with their dense twins)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    device = torch.device("cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda")
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
        for line in bench_models(args.models, args.batch, args.seq_len, args.steps, device):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
