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

`--workload grpo` is a GRPO-shaped rollout instead (issue 57): `--prompts` random prompts of `--prompt-len`
tokens x G = `--group` samples each, completion lengths drawn from a lognormal (median `--median`, sigma
`--sigma`, capped at `--max-new`) and forced by per-sequence budgets so every sampler does the same work;
a stop token is on (one the samplers can never draw: the drawable vocab stops below it). Samplers, side by
side on the same weights: `engine` (continuous batching over `--slots` slots, paged KV cache of
`--kv-cache-gib`, the G samples sharing their prompt's prefill and blocks), `static` (today's generator: a
static batch of `--static-rows` rows at a time, each decoding until its longest row ends; the first
`--static-batches` batches are timed) and `hf` (transformers' `generate` with a static cache, which it
compiles, on `--hf-rows` rows of `--hf-new-tokens` fixed-length tokens: its best case, no idle rows).
Reported: new tokens/s (useful tokens over wall time, after a warm-up call that captures graphs), the decode
step against the memory bound (static: `--static-rows` rows, cache half full; engine: `--slots` live rows at
prompt + median columns), and the peak KV memory against the ideal (every prompt once + every completion).

    python tools/bench_rollouts.py --workload grpo --presets llama-350m,llama-1b,qwen3-0.6b
    python tools/bench_rollouts.py --workload grpo --cpu-smoke
"""

from __future__ import annotations

import argparse
import json
import math
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

from fastlm.generation import Completion, Generator, SamplingOptions  # noqa: E402
from fastlm.generation.engine import Engine  # noqa: E402
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


@dataclass
class WorkloadRow:
    """One sampler on the GRPO-shaped workload."""

    preset: str
    sampler: str
    sequences: int
    new_tokens: int  # useful tokens: the sum of the forced lengths
    seconds: float
    tokens_per_second: float
    setup_seconds: float  # the warm-up call (graphs, compiles), not in `seconds`
    kv_gib: float | None  # peak KV memory (static: the cache of one batch)
    ideal_kv_gib: float  # every prompt once + every completion
    step_ms: float | None = None  # one decode step at `step_rows` live rows
    bound_step_ms: float | None = None
    step_rows: int | None = None


def load_model(preset: str, device: torch.device, min_seq_len: int = 0) -> DecoderLM:
    """The preset's model (seeded random weights), its max_seq_len raised to `min_seq_len` if shorter."""
    data = yaml.safe_load((ROOT / "configs" / "presets" / f"{preset}.yaml").read_text())
    model = dict(data["model"])
    model["max_seq_len"] = max(model.get("max_seq_len", 0), min_seq_len)
    config = RunConfig.model_validate({"model": model}).model
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


def time_hf(model: DecoderLM, prompts: list[list[int]], new_tokens: int,
            cache_implementation: str | None = None) -> tuple[float, float]:
    """(seconds, setup seconds) of transformers' generate of exactly `new_tokens` per row; `cache_implementation`
    "static" makes generate compile its decode forward (its own rule for a static cache)."""
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
    if cache_implementation is not None:
        arguments["cache_implementation"] = cache_implementation
    with torch.no_grad():
        started = time.perf_counter()
        hf.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **arguments)  # warm-up (compile)
        torch.cuda.synchronize()
        setup += time.perf_counter() - started
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


def long_tail_lengths(count: int, median: float, sigma: float, cap: int, seed: int) -> list[int]:
    """`count` completion lengths from a lognormal with this median and sigma, in [1, cap] (seeded)."""
    normal = torch.randn(count, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.exp(math.log(median) + sigma * normal).round().clamp(1, cap).long().tolist()


def kv_bytes_per_token(model: DecoderLM) -> int:
    """Keys + values of one token in every layer, bf16."""
    config = model.config
    return 2 * config.num_layers * config.kv_heads * config.head_dim * 2


def grpo_workload(model: DecoderLM, args: argparse.Namespace) -> tuple[list[list[int]], list[int], SamplingOptions]:
    """(prompts, each repeated G times; forced lengths; options with a stop token no sampler can draw)."""
    vocab = model.config.vocab_size
    rng = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, vocab - 1, (args.prompts, args.prompt_len), generator=rng).tolist()
    grouped = [prompt for prompt in prompts for _ in range(args.group)]
    lengths = long_tail_lengths(len(grouped), args.median, args.sigma, args.max_new, seed=2)
    return grouped, lengths, SamplingOptions(args.max_new, temperature=1.0, stop_tokens=(vocab - 1,))


def _sampler_tokenizer(model: DecoderLM) -> _NoTokenizer:
    return _NoTokenizer(model.config.vocab_size - 1)  # the last id (the stop token) is never drawn


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(device: torch.device, call) -> tuple[float, list[Completion]]:  # noqa: ANN001 - a closure
    _synchronize(device)
    started = time.perf_counter()
    out = call()
    _synchronize(device)
    return time.perf_counter() - started, out


def _check_lengths(completions: list[Completion], lengths: list[int], sampler: str) -> None:
    got = [len(c.tokens) for c in completions]
    if got != lengths:
        raise RuntimeError(f"{sampler}: completion lengths differ from the forced ones (first {got[:4]} vs {lengths[:4]})")


def engine_step_ms(engine: Engine, options: SamplingOptions, rows: int, filled: int) -> float:
    """Mean time of the engine's decode step with `rows` live rows whose caches hold `filled` tokens each
    (blocks taken from the cache; they are all free again at the next request)."""
    assert engine.cache is not None
    step = engine._slot_step(rows, options)
    state, size, device = step.state, engine.block_size, engine.generator.device
    per_row = -(-(filled + engine.check_every) // size)
    tables = [torch.tensor([[allocator.allocate() for _ in range(per_row)] for _ in range(rows)])
              for allocator in engine.cache.allocators]
    loaded = {"tokens": torch.randint(0, 100, (rows,)), "columns": torch.full((rows,), filled),
              "seeds": torch.arange(rows), "steps": torch.zeros(rows, dtype=torch.int64),
              "budgets": torch.full((rows,), 10**6), "done": torch.zeros(rows, dtype=torch.bool)}
    times = []
    for _ in range(4):
        state.load(loaded, [t.to(device) for t in tables])
        seconds, _ = _timed(device, lambda: [step() for _ in range(engine.check_every)])
        times.append(seconds / engine.check_every)
    return statistics.median(times[1:]) * 1e3


def run_static(model: DecoderLM, prompts: list[list[int]], lengths: list[int], options: SamplingOptions,
               args: argparse.Namespace, cuda: bool) -> WorkloadRow:
    """Today's generator: batches of --static-rows rows, each decoding until its longest row ends."""
    generator = Generator(model, _sampler_tokenizer(model), torch.bfloat16 if cuda else None, cuda_graph=cuda,
                          compile=args.compile and cuda)
    rows, device = args.static_rows, generator.device
    setup, _ = _timed(device, lambda: generator.generate(prompts[:rows], options, None, [2] * len(prompts[:rows])))
    seed = torch.Generator(device=device).manual_seed(0)
    timed = min(len(prompts), rows * args.static_batches)
    completions: list[Completion] = []

    def run() -> list[Completion]:
        for start in range(0, timed, rows):
            completions.extend(generator.generate(prompts[start : start + rows], options, seed,
                                                  lengths[start : start + rows]))
        return completions

    seconds, _ = _timed(device, run)
    lengths = lengths[:timed]
    _check_lengths(completions, lengths, "static")
    (step,) = generator._steps.values() if cuda else (None,)
    kv = sum(b.numel() * b.element_size() for b in step.cache.buffers) / 2**30 if step is not None else None
    step_ms = bound_ms = None
    if step is not None and step.graph is not None:
        column = args.prompt_len + args.max_new // 2
        step_ms, _, _ = decode_step_profile(generator, column, 0)
        bound_ms = step_bytes(model, rows, column + 1) / args.bandwidth * 1e3
    return _row(model, args, "static", lengths, seconds, setup, kv, step_ms, bound_ms, rows)


def run_engine(model: DecoderLM, prompts: list[list[int]], lengths: list[int], options: SamplingOptions,
               args: argparse.Namespace, cuda: bool) -> WorkloadRow:
    """The continuous-batching engine; the warm-up drains through every slot bucket (captures their graphs)."""
    generator = Generator(model, _sampler_tokenizer(model), torch.bfloat16 if cuda else None, cuda_graph=cuda,
                          compile=args.compile and cuda)
    engine = Engine(generator, max_slots=args.slots, kv_cache_memory_gib=args.kv_cache_gib if cuda else None)
    device = generator.device
    warm = [[3 + i % 50] * 8 for i in range(args.slots)]
    warm_lengths = [1 + (i * 97) % min(args.max_new, 3 * engine.check_every) for i in range(args.slots)]
    setup, _ = _timed(device, lambda: engine.generate(warm, options, None, warm_lengths))
    seed = torch.Generator(device=device).manual_seed(0)
    seconds, completions = _timed(device, lambda: engine.generate(prompts, options, seed, lengths))
    _check_lengths(completions, lengths, "engine")
    kv = engine.peak_bytes() / 2**30
    print(f"{args.preset} engine: peak blocks {engine.peak_blocks} of {engine.cache.num_blocks - 1}, "
          f"{engine.admissions} starts for {len(prompts)} sequences, {engine.prefilled_tokens} tokens prefilled",
          flush=True)
    filled = args.prompt_len + int(args.median)
    step_rows = min(args.slots, (engine.cache.num_blocks - 1) // -(-(filled + engine.check_every) // engine.block_size))
    step_ms = engine_step_ms(engine, options, step_rows, filled)
    bound_ms = step_bytes(model, step_rows, filled + 1) / args.bandwidth * 1e3 if cuda else None
    return _row(model, args, "engine", lengths, seconds, setup, kv, step_ms, bound_ms, step_rows)


def run_hf(model: DecoderLM, prompts: list[list[int]], lengths: list[int], args: argparse.Namespace) -> WorkloadRow:
    """transformers' generate, static cache (compiled by generate) or dynamic if that fails, fixed lengths."""
    rows = prompts[: args.hf_rows]
    try:
        seconds, setup = time_hf(model, rows, args.hf_new_tokens, "static")
        sampler = "hf (static cache, compiled)"
    except Exception:  # noqa: BLE001 - the dynamic cache still gives a number
        traceback.print_exc()
        seconds, setup = time_hf(model, rows, args.hf_new_tokens)
        sampler = "hf (dynamic cache)"
    return _row(model, args, sampler, [args.hf_new_tokens] * len(rows), seconds, setup, None, None, None, None)


def _row(model: DecoderLM, args: argparse.Namespace, sampler: str, lengths: list[int], seconds: float, setup: float,
         kv: float | None, step_ms: float | None, bound_ms: float | None, step_rows: int | None) -> WorkloadRow:
    ideal = (args.prompts * args.prompt_len + sum(args.lengths)) * kv_bytes_per_token(model) / 2**30
    row = WorkloadRow(args.preset, sampler, len(lengths), sum(lengths), seconds, sum(lengths) / seconds, setup, kv,
                      ideal, step_ms, bound_ms, step_rows)
    print(json.dumps(asdict(row)), flush=True)
    return row


def bench_workload(preset: str, args: argparse.Namespace, cuda: bool) -> list[WorkloadRow]:
    """Every sampler on one preset's GRPO-shaped workload; a failing one prints its traceback."""
    device = torch.device("cuda" if cuda else "cpu")
    torch._dynamo.reset()  # each preset compiles FlexAttention for its own shapes: no recompile limit carried over
    model = load_model(preset, device, args.prompt_len + args.max_new)
    prompts, lengths, options = grpo_workload(model, args)
    args.preset, args.lengths = preset, lengths
    print(f"{preset}: {len(prompts)} sequences, lengths median {statistics.median(lengths)}, mean "
          f"{statistics.mean(lengths):.0f}, max {max(lengths)}, {sum(lengths)} new tokens", flush=True)
    rows = []
    for sampler in args.samplers.split(","):
        try:
            if sampler == "static":
                rows.append(run_static(model, prompts, lengths, options, args, cuda))
            elif sampler == "engine":
                rows.append(run_engine(model, prompts, lengths, options, args, cuda))
            elif cuda:
                rows.append(run_hf(model, prompts, lengths, args))
        except Exception:  # noqa: BLE001 - keep the other samplers
            print(f"{preset} {sampler}: FAILED", flush=True)
            traceback.print_exc()
        if cuda:
            torch.cuda.empty_cache()
    return rows


def workload_summary(rows: list[WorkloadRow]) -> str:
    lines = ["| preset | sampler | new tokens/s | vs static | step ms (bound) at rows | of bound | peak KV GiB "
             "(ideal) | warm-up s |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        static = next((r for r in rows if r.preset == row.preset and r.sampler == "static"), None)
        ratio = f"{row.tokens_per_second / static.tokens_per_second:.2f}x" if static else "-"
        step = (f"{row.step_ms:.3f} ({row.bound_step_ms:.3f}) at {row.step_rows}"
                if row.step_ms is not None and row.bound_step_ms is not None else "-")
        fraction = f"{row.bound_step_ms / row.step_ms:.0%}" if row.step_ms and row.bound_step_ms else "-"
        kv = f"{row.kv_gib:.2f} ({row.ideal_kv_gib:.2f})" if row.kv_gib is not None else "-"
        lines.append(f"| {row.preset} | {row.sampler} | {row.tokens_per_second:,.0f} | {ratio} | {step} | {fraction} "
                     f"| {kv} | {row.setup_seconds:.1f} |")
    return "\n".join(lines)


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
    parser.add_argument("--workload", choices=("fixed", "grpo"), default="fixed",
                        help="fixed: every row the same length, per decode mode; grpo: the long-tailed GRPO rollout")
    parser.add_argument("--presets", default="llama-350m,llama-1b")
    parser.add_argument("--modes", default="graph,compile,hf", help=f"fixed: any of {', '.join(MODES)}")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, help="default 128 (fixed), 256 (grpo)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--hf-new-tokens", type=int, help="new tokens of the hf row (default --new-tokens; grpo 128)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top-kernels", type=int, default=8, help="kernels listed per profiled decode step")
    grpo = parser.add_argument_group("grpo workload")
    grpo.add_argument("--samplers", default="engine,static,hf", help="in this order (a time box cuts the last)")
    grpo.add_argument("--prompts", type=int, default=64)
    grpo.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    grpo.add_argument("--median", type=float, default=500.0, help="median completion length")
    grpo.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the completion lengths")
    grpo.add_argument("--max-new", type=int, default=4096, help="completion cap (max_new_tokens)")
    grpo.add_argument("--static-rows", type=int, default=128, help="rows of one static batch")
    grpo.add_argument("--static-batches", type=int, default=2,
                      help="static batches timed (each decodes to its longest row, ~--max-new steps; the rest "
                      "would take as long each)")
    grpo.add_argument("--slots", type=int, default=256, help="engine decode slots")
    grpo.add_argument("--kv-cache-gib", type=float, default=32.0, help="engine paged cache size")
    grpo.add_argument("--hf-rows", type=int, default=64)
    grpo.add_argument("--compile", action="store_true", help="torch.compile the static and engine decode steps")
    parser.add_argument("--out", type=Path, help="directory for bench_rollouts.json")
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--smoke-preset", default="tiny-llama", help="the --cpu-smoke preset (qwen3.5-tiny: the hybrid)")
    args = parser.parse_args()
    grpo_run = args.workload == "grpo"
    args.prompt_len = args.prompt_len or (256 if grpo_run else 128)
    args.hf_new_tokens = args.hf_new_tokens or (128 if grpo_run else args.new_tokens)
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    if args.cpu_smoke:
        if not grpo_run:
            cpu_smoke(args.smoke_preset)
            return
        args.prompts, args.group, args.prompt_len, args.median, args.max_new = 4, 2, 16, 6.0, 24
        args.static_rows, args.slots, args.bandwidth = 4, 4, None
        rows = bench_workload(args.smoke_preset, args, cuda=False)
        print("\n" + workload_summary(rows))
        assert {r.sampler for r in rows} == {"static", "engine"}, "a sampler failed (traceback above)"
        return
    if not torch.cuda.is_available():
        sys.exit("bench_rollouts needs a CUDA device (or --cpu-smoke)")
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | copy bandwidth {bandwidth / 1e12:.2f} TB/s",
          flush=True)
    results: list[Row] | list[WorkloadRow]
    if grpo_run:
        args.bandwidth = bandwidth
        results = [row for preset in args.presets.split(",") for row in bench_workload(preset, args, cuda=True)]
        print("\n" + workload_summary(results))
    else:
        rng = torch.Generator().manual_seed(1)
        results = [row for preset in args.presets.split(",") for row in bench_preset(preset, args, bandwidth, rng)]
        print("\n" + summary(results))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = "bench_rollouts_grpo.json" if grpo_run else "bench_rollouts.json"
        (args.out / name).write_text(json.dumps([asdict(r) for r in results], indent=1))


if __name__ == "__main__":
    main()
