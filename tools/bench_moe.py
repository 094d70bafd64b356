"""The MoE layer's speed: fastlm's experts on torch._grouped_mm (`grouped`), on its Triton grouped GEMMs
(`triton`) and on the per-expert loop against transformers' own sparse MoE block (Qwen3-MoE's, eager experts
and its `grouped_mm` experts) on the same weights, forward + backward, bf16; and whole models: an MoE preset
against a dense model of equal active size, tokens/s and MFU counted on active parameters
(tools/bench_train.py's loop).

    python tools/bench_moe.py                        # CUDA: layer shapes (16-64 experts, top-2..8, hidden 1024-2048)
    python tools/bench_moe.py --models olmoe-1b-7b --num-layers 4 --batch 4 --seq-len 2048
                                                      # + whole models: the preset on grouped GEMMs, on the
                                                      #   Triton GEMMs, on the loop, and its dense twin
    python tools/bench_moe.py --models olmoe-1b-7b --num-layers 4 --batch 4 --grad-accumulation 4
                                                      # the same at 4 micro-batches an optimizer step
    python tools/bench_moe.py --models olmoe-1b-7b --num-layers 4 --batch 4 --seq-len 2048 --profile
                                                      # + where a step's device time goes (torch.profiler, a few
                                                      #   steps after a warm-up), the dense twin and the grouped
                                                      #   model: per category (optimizer, casts/copies, grouped
                                                      #   GEMMs, other GEMMs, attention, routing & permutation,
                                                      #   other), the top-12 kernels, and the MoE step's extra
                                                      #   per category
    python tools/bench_moe.py --triton-sweep          # + the Triton kernels' tile choices per layer shape
    python tools/bench_moe.py --cpu-smoke --models mixtral-tiny   # CPU: tiny shapes, float32 (CI smoke test;
                                                      #   the Triton layer row under TRITON_INTERPRET=1;
                                                      #   --profile: the CPU ops' self time by aten op name)

Each layer row also prints its largest error against fastlm's loop (relative to the output's largest
value, and the same for the input gradient): on the GPU, the check that every path agrees within bf16.
0.0e+00 is bitwise equality, which two GEMMs reach when each dot product accumulates its K chunks in the
same order (one CPU thread at the smoke shape; on the GPU, tensor-core GEMMs that all walk K in order),
so each fastlm row first checks on its autograd graph that its own GEMMs ran: a row whose backend did
not run says so instead of an error.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if "--cpu-smoke" in sys.argv:  # the Triton row runs interpreted; triton reads this when first imported (fastlm.layers does)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastlm.layers.moe import (  # noqa: E402 - after the repository joins the path
    MoEMLP,
    expert_counts,
    route,
    triton_grouped_mm_supported,
)


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


EXPERT_GEMM_NODES = {"GroupedLinearBackward": "triton", "GroupedMmBackward0": "grouped"}
"""The autograd node each grouped path leaves in the graph (the loop leaves per-expert `MmBackward0`s)."""


def expert_gemm_path(out: torch.Tensor) -> str:
    """Which experts' GEMMs produced `out`: the grouped backend whose node is in its autograd graph, else the loop."""
    seen, pending, found = set(), [out.grad_fn], set()
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        found.add(EXPERT_GEMM_NODES.get(type(node).__name__, "loop"))
        pending.extend(parent for parent, _ in node.next_functions)
    return " + ".join(sorted(found - {"loop"})) or "loop"


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
            return out, x.grad

        return run

    results: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    times: dict[str, float | None] = {}
    ran_instead: dict[str, str] = {}  # a fastlm row whose forward took other GEMMs than its backend's
    for backend in ("grouped", "triton", "loop"):
        if backend == "triton" and not triton_grouped_mm_supported(device, dtype):
            print(f"{shape}: fastlm triton skipped (no Triton for {dtype} on {device.type}; on the CPU it runs "
                  "under TRITON_INTERPRET=1, which --cpu-smoke sets)")
            continue
        layer.backend, name = backend, f"fastlm {backend}"
        out, dx = fwd_bwd(layer)()
        if (path := expert_gemm_path(out)) != backend:
            ran_instead[name], times[name] = path, None  # None keeps the row's place in the table
            continue
        results[name] = out.detach(), dx
        times[name] = time_ms(fwd_bwd(layer), device, repeats, warmup)
    for implementation in (None, "grouped_mm") if device.type == "cuda" else (None,):
        name = f"transformers {implementation or 'eager'}"
        try:
            block = transformers_block(shape, implementation, layer)
            out, dx = fwd_bwd(block)()
            results[name] = out.detach(), dx
            times[name] = time_ms(fwd_bwd(block), device, repeats, warmup)
        except Exception as error:  # noqa: BLE001 - a peer the installed transformers cannot run here
            print(f"{shape}: {name} did not run ({type(error).__name__}: {str(error)[:120]})")
    out_loop, dx_loop = results["fastlm loop"]
    reference = times.get("transformers eager")
    rows = []
    for name, ms in times.items():
        if ms is None:
            rows.append(f"| {shape} | {name} | - | - | did not run (its forward took the {ran_instead[name]} GEMMs) |")
            continue
        speedup = f"{reference / ms:.2f}x" if reference else "-"
        out, dx = results[name]
        rows.append(f"| {shape} | {name} | {ms:.2f} | {speedup} | {_max_rel(out, out_loop):.1e} / {_max_rel(dx, dx_loop):.1e} |")
    return rows


SWEEP_BLOCKS = [(64, 128, 64, 4, 3), (64, 256, 64, 8, 3), (128, 64, 64, 4, 4), (128, 128, 32, 8, 4),
                (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (128, 256, 32, 8, 4)]
"""(m, n, k, warps, stages) of the Triton grouped GEMMs for --triton-sweep."""


def sweep_triton_blocks(shape: LayerShape, device: torch.device, dtype: torch.dtype, repeats: int, warmup: int) -> list[str]:
    """The experts' fwd+bwd alone (both grouped GEMMs, their gradients and the SwiGLU between) on a router's
    real counts: each Triton tiling of SWEEP_BLOCKS, the default and torch._grouped_mm."""
    from fastlm.layers.moe import expert_mlp, triton_expert_mlp
    from fastlm.layers.triton_grouped_mm import Blocks, default_blocks

    torch.manual_seed(0)
    layer = MoEMLP(shape.hidden, shape.ffn, shape.experts, shape.top_k, True).to(device=device, dtype=dtype)
    layer.reset_parameters(0.02, 0.02)
    x = torch.randn(shape.tokens, shape.hidden, device=device, dtype=dtype)
    experts = route(x, layer.router.weight, shape.top_k, True).experts.reshape(-1)
    order = experts.argsort(stable=True)
    counts = expert_counts(experts, shape.experts)
    rows = x[order // shape.top_k].detach().requires_grad_()
    gate_up, down = (w.detach().requires_grad_() for w in layer.expert_weights())
    grad = torch.randn_like(rows)

    def fwd_bwd(run) -> float:
        def step() -> None:
            rows.grad = gate_up.grad = down.grad = None
            run().backward(grad)

        return time_ms(step, device, repeats, warmup)

    default = default_blocks(rows.shape[0], shape.experts, device)
    candidates = [Blocks(m, n, k, warps=warps, stages=stages) for m, n, k, warps, stages in SWEEP_BLOCKS]
    reference = fwd_bwd(lambda: expert_mlp(rows, experts[order], counts, gate_up, down, "grouped"))
    lines = [f"| {shape} | torch._grouped_mm | {reference:.2f} | 1.00x |"]
    for blocks in ([default] + [b for b in candidates if b != default]):
        ms = fwd_bwd(lambda blocks=blocks: triton_expert_mlp(rows, counts, gate_up, down, blocks))
        tiles = f"m{blocks.m} n{blocks.n} k{blocks.k} w{blocks.warps} s{blocks.stages}"
        lines.append(f"| {shape} | triton {tiles}{' (default)' if blocks == default else ''} | {ms:.2f} | "
                     f"{reference / ms:.2f}x |")
    return lines


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


@dataclass
class TrainingStep:
    """One optimizer step of a built model and optimizer on synthetic rows: what the timer and the profiler run."""

    model_config: Any  # the validated model section (for the FLOP and parameter counts)
    run: Callable[[], None]


def training_step(config: Any, batch: int, seq_len: int, device: torch.device, accumulation: int) -> TrainingStep:
    """tools/bench_train.py's step (bf16 autocast on CUDA, the chunked head's CE + z-loss, fused AdamW) on
    synthetic rows, `accumulation` micro-batches per optimizer step (the optimizer's cost grows with the total
    parameters, the micro-batches' with the active ones)."""
    from train_loops import synthetic_batches

    from fastlm.engine.optim import build_optimizer
    from fastlm.losses.spec import LossNormalizers, LossTargets
    from fastlm.models import build_model
    from fastlm.run_config.schema import RunConfig
    from fastlm.system.device import autocast

    run = RunConfig.model_validate({"model": config.model_dump()})
    torch.manual_seed(0)
    model = build_model(run.model, device=device).train()
    optimizer = build_optimizer(model, run.optimizer)
    amp = torch.bfloat16 if device.type == "cuda" else None
    batches = synthetic_batches(config.vocab_size, batch, seq_len, False, device)

    def step() -> None:
        for micro in range(accumulation):
            rows = batches[micro % len(batches)]
            with autocast(device, amp):
                result = model(rows.input_ids, LossTargets(labels=rows.labels),
                               LossNormalizers(tokens=rows.tokens * accumulation, micro_batches=accumulation,
                                               positions=float(rows.input_ids.numel() * accumulation)))
            result.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return TrainingStep(run.model, step)


def time_model(name: str, config: Any, batch: int, seq_len: int, steps: int, device: torch.device, peak: float,
               accumulation: int = 1) -> ModelRow:
    """`training_step`'s tokens/s, peak memory and MFU on the active parameters' FLOPs."""
    from fastlm.models import active_parameters, model_flops_per_token, num_parameters

    step = training_step(config, batch, seq_len, device, accumulation)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ms = time_ms(step.run, device, steps, 2)
    tokens_per_second = accumulation * batch * seq_len / (ms / 1e3)
    mfu = model_flops_per_token(step.model_config, seq_len) * tokens_per_second / peak
    memory = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    return ModelRow(name, num_parameters(step.model_config), active_parameters(step.model_config), tokens_per_second,
                    mfu, memory)


PROFILE_STEPS = 3
OTHER_CATEGORY = "elementwise/norm/other"
CATEGORY_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("optimizer", ("adam", "multi_tensor_apply")),
    ("grouped GEMMs", ("grouped", "groupproblemshape")),
    ("attention", ("flash", "sdpa", "fmha", "attention")),
    ("other GEMMs", ("gemm", "gemv", "matmul", "nvjet", "cutlass", "xmma", "cublas", "aten::mm", "aten::addmm",
                     "aten::bmm", "aten::linear", "mmbackward")),
    ("routing & permutation", ("topk", "sort", "gather", "scatter", "index", "cumsum", "scan", "histc", "histogram",
                               "bincount")),
    ("casts/copies", ("copy", "withcast", "memcpy", "aten::to", "_add<float>", "aten::add_", "accumulategrad")),
)
"""A CUDA kernel's or (CPU) an aten op's lower-cased name goes to the first category holding one of its
substrings, else OTHER_CATEGORY. The order decides overlaps: cutlass's grouped GEMM and fmha before the other
cutlass GEMMs, topk before aten::to. fp32 adds (`_add<float>`, CPU aten::add_) count as copies: they are the
fp32 gradients' accumulation (residual adds run in bf16). The embedding's lookup and its backward's sort land in
routing for the dense twin too, so the MoE model's extra there is its own routing. On the CPU (a smoke test)
torch._grouped_mm runs a per-expert aten::mm, which counts as other GEMMs."""


def category_of(name: str) -> str:
    lowered = name.lower()
    return next((category for category, parts in CATEGORY_RULES if any(part in lowered for part in parts)),
                OTHER_CATEGORY)


@dataclass
class StepProfile:
    """Where one training step spends device time (CPU: the ops' self time), per step."""

    kernels: dict[str, tuple[float, float]]  # kernel (CPU: op) name -> (calls, ms)
    busy_ms: float  # the union of the kernels' (CPU: outermost ops') intervals: the step's busy time
    wall_ms: float

    def categories(self) -> dict[str, float]:
        totals = dict.fromkeys([category for category, _ in CATEGORY_RULES] + [OTHER_CATEGORY], 0.0)
        for name, (_, ms) in self.kernels.items():
            totals[category_of(name)] += ms
        return totals


def profile_step(step: Callable[[], None], device: torch.device, steps: int = PROFILE_STEPS) -> StepProfile:
    """`steps` steps under torch.profiler after a warm-up step: CUDA kernels (not the annotations spanning them)
    on the GPU; on the CPU each op's self time, which adds up to its outermost ops' time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step()
    _synchronize(device)
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as profiler:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        _synchronize(device)
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
    if cuda:
        events = [e for e in profiler.events() if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
        spans = [e.time_range for e in events]
    else:
        events = [e for e in profiler.events() if e.device_type == DeviceType.CPU and not e.is_async]
        spans = [e.time_range for e in events if e.cpu_parent is None]
    kernels: dict[str, tuple[float, float]] = {}
    for event in events:
        calls, ms = kernels.get(event.name, (0.0, 0.0))
        us = event.time_range.elapsed_us() if cuda else event.self_cpu_time_total
        kernels[event.name] = calls + 1 / steps, ms + us / 1e3 / steps
    busy_us, covered_to = 0.0, float("-inf")
    for span in sorted(spans, key=lambda span: span.start):
        busy_us += max(0.0, span.end - max(span.start, covered_to))
        covered_to = max(covered_to, span.end)
    return StepProfile(kernels, busy_us / 1e3 / steps, wall_ms)


def profile_lines(preset: str, dense: StepProfile, moe: StepProfile) -> list[str]:
    """Per model the categories' and the top-12 kernels' ms a step, then the MoE step's extra per category."""
    lines: list[str] = []
    for name, profile in ((f"{preset} dense twin", dense), (f"{preset} grouped", moe)):
        lines += ["", f"profile of {name}: {profile.busy_ms:.2f} ms busy a step ({profile.wall_ms:.2f} ms wall under "
                  f"the profiler), {PROFILE_STEPS} steps after a warm-up",
                  "| category | ms / step | % of step |", "| --- | --- | --- |"]
        lines += [f"| {category} | {ms:.3f} | {ms / profile.busy_ms:.1%} |" for category, ms in profile.categories().items()]
        lines += [f"| total (busy) | {profile.busy_ms:.3f} | 100.0% |", "",
                  "| top kernel | category | calls / step | ms / step | % of step |", "| --- | --- | --- | --- | --- |"]
        for kernel, (calls, ms) in sorted(profile.kernels.items(), key=lambda item: -item[1][1])[:12]:
            lines.append(f"| {kernel[:70].replace('|', '/')} | {category_of(kernel)} | {calls:g} | {ms:.3f} | "
                         f"{ms / profile.busy_ms:.1%} |")
    extra = moe.busy_ms - dense.busy_ms
    lines += ["", f"where the extra time goes: {preset} grouped minus its dense twin, {extra:.2f} ms a step",
              "| category | dense twin ms | grouped ms | extra ms | share of extra |", "| --- | --- | --- | --- | --- |"]
    dense_categories = dense.categories()
    for category, ms in moe.categories().items():
        share = f"{(ms - dense_categories[category]) / extra:.1%}" if extra > 0 else "-"
        lines.append(f"| {category} | {dense_categories[category]:.3f} | {ms:.3f} | "
                     f"{ms - dense_categories[category]:+.3f} | {share} |")
    return lines


def bench_models(presets: list[str], batch: int, seq_len: int, steps: int, device: torch.device,
                 num_layers: int | None = None, accumulation: int = 1, profile: bool = False,
                 backends: tuple[str, ...] = ("grouped", "triton", "loop")) -> list[str]:
    """Each MoE preset on grouped GEMMs, on the Triton GEMMs (GPU) and on the loop, and its dense twin, in one run; `num_layers`
    shortens the presets (OLMoE-1B-7B whole needs ~110 GB for fp32 weights, gradients and AdamW). `profile`:
    after each preset's rows, where the dense twin's and the grouped model's steps spend their time."""
    import yaml
    from train_loops import measured_peak_flops

    from fastlm.run_config.schema import RunConfig

    peak = measured_peak_flops(device)
    table_head = ["| model | params | active | tokens/s | MFU (active) | peak mem GiB | MFU / dense twin's |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
    lines = [f"matmul peak {peak / 1e12:.1f} TFLOP/s; batch {batch} x seq {seq_len}, {accumulation} micro-batches a step"]
    for index, preset in enumerate(presets):
        if index == 0 or profile:  # a profile's tables end the previous preset's table
            lines += table_head
        document = yaml.safe_load((ROOT / "configs" / "presets" / f"{preset}.yaml").read_text())
        if num_layers:
            document["model"]["num_layers"] = num_layers
        config = RunConfig.model_validate(document).model

        def on_backend(backend: str, config: Any = config) -> Any:
            return config.model_copy(update={"moe": config.moe.model_copy(update={"backend": backend})})

        rows = [time_model(f"{preset} dense twin", dense_twin(config), batch, seq_len, steps, device, peak, accumulation)]
        # the interpreted Triton path would take minutes on the CPU: GPU only
        for backend in (b for b in backends if device.type == "cuda" or b != "triton"):
            rows.append(time_model(f"{preset} {backend}", on_backend(backend), batch, seq_len, steps, device, peak,
                                   accumulation))
        if device.type == "cuda":
            torch.cuda.empty_cache()
        for row in rows:
            lines.append(f"| {row.name} | {row.parameters / 1e6:.1f}M | {row.active / 1e6:.1f}M | "
                         f"{row.tokens_per_second:,.0f} | {row.mfu:.1%} | {row.peak_memory_gib:.1f} | "
                         f"{row.mfu / rows[0].mfu:.2f} |")
        if profile:
            dense, moe = (profile_step(training_step(model, batch, seq_len, device, accumulation).run, device)
                          for model in (dense_twin(config), on_backend("grouped")))
            lines += [*profile_lines(preset, dense, moe), ""]
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
    parser.add_argument("--grad-accumulation", type=int, default=1, help="--models: micro-batches per optimizer step")
    parser.add_argument("--profile", action="store_true",
                        help="--models: where the dense twin's and the grouped model's training steps spend their time")
    parser.add_argument("--backends", default="grouped,triton,loop", help="--models: the MoE rows' expert backends")
    parser.add_argument("--models-only", action="store_true", help="--models without the layer table")
    parser.add_argument("--triton-sweep", action="store_true", help="time the Triton GEMMs' tilings per layer shape")
    args = parser.parse_args()
    device = torch.device("cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda")
    if args.cpu_smoke:
        torch.set_num_threads(1)  # tiny shapes: a second thread only waits at the barriers of a busy machine
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    shapes = CPU_SHAPES if device.type == "cpu" else GPU_SHAPES
    repeats, warmup = (2, 1) if args.cpu_smoke else (args.repeats, 3)
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; torch {torch.__version__}; {dtype}")
    if not args.models_only:
        print("| shape | implementation | fwd+bwd ms | vs transformers eager | vs fastlm loop: out / dx max rel err |")
        print("| --- | --- | --- | --- | --- |")
        for shape in shapes:
            for row in bench_layer(shape, device, dtype, repeats, warmup):
                print(row)
    if args.triton_sweep:
        print("| shape | experts' GEMMs | fwd+bwd ms | vs torch._grouped_mm |\n| --- | --- | --- | --- |")
        for shape in shapes:
            for row in sweep_triton_blocks(shape, device, dtype, repeats, warmup):
                print(row)
    if args.models:
        batch, seq_len, steps = (2, 32, 1) if args.cpu_smoke else (args.batch, args.seq_len, args.steps)
        for line in bench_models(args.models, batch, seq_len, steps, device, args.num_layers, args.grad_accumulation,
                                 args.profile, tuple(args.backends.split(","))):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
