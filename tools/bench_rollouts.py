"""Rollout throughput: fastlm's KV-cache generator against transformers' `generate` on the same weights,
and the memory-bandwidth bound, in one run.

    python tools/bench_rollouts.py                          # CUDA: llama-350m and llama-1b, 64 x 128 prompts, 256 new
    python tools/bench_rollouts.py --presets llama-350m --modes graph-sdpa,graph,compile,hf --hf-new-tokens 32
    python tools/bench_rollouts.py --cpu-smoke              # CPU: tiny preset, eager + the profile code path
    python tools/bench_rollouts.py --presets qwen3.5-0.8b,qwen3.5-2b --modes graph,compile,hf   # the hybrid:
                                                            # recurrent states in the cache, 64 x 256 new tokens
    python tools/bench_rollouts.py --cpu-smoke --smoke-preset qwen3.5-tiny

Every mode samples (temperature 1, no top-k/top-p, no stop token) exactly `--new-tokens` tokens per row
from random-token prompts of `--prompt-len`, bf16 on CUDA. Modes: `eager` (live fp32 weights under bf16
autocast, no graph, SDPA: what a run without graphs does), `graph` (bf16 replica, decode step with
FlexAttention decode and the sampling tail captured in a CUDA graph), `compile` (the same step through
torch.compile first: one graph, then captured); a `-sdpa` suffix (`graph-sdpa`, `compile-sdpa`) attends
with SDPA and the additive mask over the whole cache instead (the previous decode attention);
`compile-autotune` lets inductor benchmark Triton GEMMs against cuBLAS for the M = batch matmuls (a longer
compile). `hf` is
transformers' generate with its dynamic KV cache on a bf16 copy of the same weights (SDPA attention),
timed over `--hf-new-tokens` (default `--new-tokens`; fewer keeps the run short, and its per-token cost
only grows with the length, so a shorter run flatters it). The bound: per decode step the bytes that
must be read (every bf16 matrix once, B embedding rows, the KV cache filled so far, read once) plus the
new keys and values written (linear-attention layers: their fixed-size states read and written), over the
copy bandwidth measured in this run (bytes read + written per second).

Graph modes also report the decode step alone: the GPU time of one replay with the cache half full (CUDA
events, mean of 20) and the number of GPU kernels in it (torch.profiler over one replay), with the top
kernels by time printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastlm.generation import Generator, SamplingOptions  # noqa: E402
from fastlm.models.decoder import DecoderLM, build_model  # noqa: E402
from fastlm.run_config.schema import RunConfig  # noqa: E402 - after the path fix


@dataclass
class Row:
    preset: str
    mode: str
    batch: int
    prompt_len: int
    new_tokens: int  # timed new tokens per row (hf: --hf-new-tokens)
    seconds: float
    tokens_per_second: float
    setup_seconds: float  # first call: replica, graph capture, compile (not in `seconds`)
    bound_tokens_per_second: float
    fraction_of_bound: float
    step_ms: float | None = None  # graph modes: one decode step replayed with the cache half full
    step_kernels: int | None = None  # GPU kernels (and copies) in that step
    bound_step_ms: float | None = None  # the bound of that step


@dataclass(frozen=True)
class _NoTokenizer:
    """Random prompts need no text: every id of the model's vocab is drawable, none stops a row."""

    vocab_size: int
    pad_id: int = 0
    eos_id: int | None = None


MODES = ("eager", "graph", "graph-sdpa", "compile", "compile-sdpa", "compile-autotune", "hf")


def load_model(preset: str, device: torch.device) -> DecoderLM:
    data = yaml.safe_load((ROOT / "configs" / "presets" / f"{preset}.yaml").read_text())
    config = RunConfig.model_validate({"model": data["model"]}).model
    torch.manual_seed(0)
    return build_model(config, device=device)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a large device-to-device copy (median of 20)."""
    source = torch.randn(512 * 2**20, device=device, dtype=torch.bfloat16)  # 1 GiB
    target = torch.empty_like(source)
    times = []
    for _ in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * source.numel() * source.element_size() / statistics.median(times[3:])


def step_bytes(model: DecoderLM, batch: int, filled: int) -> int:
    """One decode step with `filled` cache columns read: bf16 matrices + B embedding rows + the filled KV
    cache + the new keys and values written."""
    config = model.config
    matrices = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith("embeddings."))
    if config.tie_embeddings:
        matrices += model.output_weight.numel()
    weight_bytes = 2 * matrices + 2 * batch * config.hidden_size
    states = [config.recurrent_state(layer) for layer in range(config.num_layers)]
    kv_layers = sum(state is None for state in states)
    kv_per_token = 2 * kv_layers * config.kv_heads * config.head_dim * 2  # keys + values, bf16
    # linear-attention layers: the fp32 state and the bf16 conv window, read and written once per step
    recurrent = sum(2 * (4 * s.heads * s.key_dim * s.value_dim + 2 * (s.conv_width - 1) * s.conv_channels)
                    for s in states if s is not None)
    return weight_bytes + batch * kv_per_token * (filled + 1) + batch * recurrent


def bound_seconds(model: DecoderLM, batch: int, prompt_len: int, new_tokens: int, bandwidth: float) -> float:
    """Sum over decode steps of `step_bytes` / bw (the first new token comes from the prefill)."""
    return sum(step_bytes(model, batch, prompt_len + step + 1) / bandwidth for step in range(new_tokens - 1))


def engine(model: DecoderLM, mode: str) -> Generator:
    """The generator of a mode: `base[-sdpa][-autotune]` (autotune: inductor benchmarks GEMM kernels for
    this compile, `max_autotune_gemm`; it applies to compiles, which happen on the first call)."""
    base, *flags = mode.split("-")
    inductor_config.max_autotune_gemm = "autotune" in flags
    return Generator(model, _NoTokenizer(model.config.vocab_size), torch.bfloat16 if model.output_weight.is_cuda else None,
                     cuda_graph=base != "eager", compile=base == "compile",
                     decode_attention="sdpa" if "sdpa" in flags else None)


def time_ours(generator: Generator, prompts: list[list[int]], options: SamplingOptions,
              repeats: int) -> tuple[float, float]:
    """(median seconds of `repeats` generate calls, seconds of the first call)."""
    seed = torch.Generator(device=generator.device).manual_seed(0)
    times = []
    for _ in range(max(repeats, 1) + (repeats > 0)):
        torch.cuda.synchronize()
        started = time.perf_counter()
        completions = generator.generate(prompts, options, seed)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        assert all(len(c.tokens) == options.max_new_tokens for c in completions)
    return statistics.median(times[1:] or times), times[0]


def time_hf(model: DecoderLM, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    import transformers

    from fastlm.data.tokenizer import ByteTokenizer
    from fastlm.models.hf import export_hf

    with tempfile.TemporaryDirectory() as directory:
        started = time.perf_counter()
        export_hf(model, directory, ByteTokenizer())  # the weights are what generate reads; any tokenizer's files do
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
        setup = time.perf_counter() - started
    input_ids = torch.tensor(prompts, device="cuda")
    arguments = dict(attention_mask=torch.ones_like(input_ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                     pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        hf.generate(input_ids, max_new_tokens=4, min_new_tokens=4, **arguments)  # warm-up
        torch.cuda.synchronize()
        started = time.perf_counter()
        out = hf.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **arguments)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    assert out.shape[1] == input_ids.shape[1] + new_tokens
    del hf
    torch.cuda.empty_cache()
    return seconds, setup


def decode_step_profile(generator: Generator, column: int, top: int) -> tuple[float, int, str]:
    """(ms per replay, kernels per replay, top kernels table) of the generator's captured decode step, run
    from cache column `column` (each replay writes one column further; the state is left as after a
    generation, so the next generate call resets it)."""
    from torch.profiler import ProfilerActivity, profile

    (step,) = generator._steps.values()
    assert step.graph is not None
    replays = min(20, step.state.drawn.shape[1] - 1, step.cache.length - column - 1)  # stay inside the buffers
    assert replays >= 1, "no room in the cache or the budget to replay the step"

    def rewind() -> None:
        step.state.columns.fill_(column)
        step.state.index.zero_()

    rewind()
    step.graph.replay()  # warm
    rewind()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        step.graph.replay()
    end.record()
    end.synchronize()
    rewind()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step.graph.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = sum(e.count for e in events)
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    lines = [f"    {e.device_time_total:8.1f} us  {e.count:4d}x  {e.key[:90]}" for e in events[:top]]
    return start.elapsed_time(end) / replays, kernels, "\n".join(lines)


def cpu_smoke(preset: str) -> None:
    model = load_model(preset, torch.device("cpu"))
    prompts = [[1] * 8] * 4
    completions = engine(model, "eager").generate(prompts, SamplingOptions(6), torch.Generator().manual_seed(0))
    assert [len(c.tokens) for c in completions] == [6] * 4
    print(f"cpu smoke ({preset}): 4 x 6 tokens generated; decode step bound {step_bytes(model, 4, 14):,} bytes")


def bench_preset(preset: str, args: argparse.Namespace, bandwidth: float, rng: torch.Generator) -> list[Row]:
    """Every mode on one preset's weights; a mode that fails prints its traceback and the others still run."""
    model = load_model(preset, torch.device("cuda"))
    prompts = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt_len), generator=rng).tolist()
    rows = []
    for mode in args.modes.split(","):
        try:
            new_tokens = args.hf_new_tokens if mode == "hf" else args.new_tokens
            step: tuple[float | None, int | None, float | None] = (None, None, None)
            if mode == "hf":
                seconds, setup = time_hf(model, prompts, new_tokens)
            else:
                generator = engine(model, mode)
                requested = generator.compile, generator.decode_attention
                options = SamplingOptions(new_tokens, temperature=1.0)
                seconds, setup = time_ours(generator, prompts, options, 0 if mode == "eager" else args.repeats)
                if (generator.compile, generator.decode_attention) != requested:
                    raise RuntimeError(f"{mode} fell back to the uncompiled SDPA step (the line above says why)")
                if generator.cuda_graph:
                    column = args.prompt_len + new_tokens // 2
                    step_ms, kernels, table = decode_step_profile(generator, column, args.top_kernels)
                    bound_ms = step_bytes(model, args.batch, column + 1) / bandwidth * 1e3
                    step = (step_ms, kernels, bound_ms)
                    print(f"{preset} {mode}: decode step at column {column}: {step_ms:.3f} ms (bound {bound_ms:.3f}), "
                          f"{kernels} GPU kernels; top by time:\n{table}", flush=True)
                del generator
            bound = bound_seconds(model, args.batch, args.prompt_len, new_tokens, bandwidth)
            new = args.batch * new_tokens
            row = Row(preset, mode, args.batch, args.prompt_len, new_tokens, seconds, new / seconds, setup,
                      new / bound, bound / seconds, *step)
            rows.append(row)
            print(json.dumps(asdict(row)), flush=True)
        except Exception:  # noqa: BLE001 - keep the other measurements
            print(f"{preset} {mode}: FAILED", flush=True)
            traceback.print_exc()
        torch.cuda.empty_cache()
    return rows


def summary(rows: list[Row]) -> str:
    lines = ["| preset | mode | new tokens/s | vs hf | bound tokens/s | of bound | step ms (bound) | kernels/step "
             "| first call s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        hf = next((r for r in rows if r.preset == row.preset and r.mode == "hf"), None)
        ratio = f"{row.tokens_per_second / hf.tokens_per_second:.1f}x" if hf else "-"
        mode = row.mode if row.mode != "hf" else f"hf ({row.new_tokens} new)"
        step = f"{row.step_ms:.3f} ({row.bound_step_ms:.3f})" if row.step_ms is not None else "-"
        lines.append(f"| {row.preset} | {mode} | {row.tokens_per_second:,.0f} | {ratio} | "
                     f"{row.bound_tokens_per_second:,.0f} | {row.fraction_of_bound:.0%} | {step} | "
                     f"{row.step_kernels if row.step_kernels is not None else '-'} | {row.setup_seconds:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="llama-350m,llama-1b")
    parser.add_argument("--modes", default="graph,compile,hf", help=f"any of {', '.join(MODES)}")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--hf-new-tokens", type=int, help="new tokens of the hf row (default --new-tokens)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top-kernels", type=int, default=8, help="kernels listed per profiled decode step")
    parser.add_argument("--out", type=Path, help="directory for bench_rollouts.json")
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--smoke-preset", default="tiny-llama", help="the --cpu-smoke preset (qwen3.5-tiny: the hybrid)")
    args = parser.parse_args()
    args.hf_new_tokens = args.hf_new_tokens or args.new_tokens
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    if args.cpu_smoke:
        cpu_smoke(args.smoke_preset)
        return
    if not torch.cuda.is_available():
        sys.exit("bench_rollouts needs a CUDA device (or --cpu-smoke)")
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | copy bandwidth {bandwidth / 1e12:.2f} TB/s",
          flush=True)
    rows: list[Row] = []
    rng = torch.Generator().manual_seed(1)
    for preset in args.presets.split(","):
        rows += bench_preset(preset, args, bandwidth, rng)
    print("\n" + summary(rows))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_rollouts.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
