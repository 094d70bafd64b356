"""Rollout throughput: fastlm's KV-cache generator against transformers' `generate` on the same weights,
and the memory-bandwidth bound, in one run.

    python tools/bench_rollouts.py                          # CUDA: llama-350m and llama-1b, 64 x 128 prompts, 256 new
    python tools/bench_rollouts.py --presets llama-350m --modes graph,compile
    python tools/bench_rollouts.py --cpu-smoke              # CPU: tiny preset, eager only (CI smoke test)

Every mode samples (temperature 1, no top-k/top-p, no stop token) exactly `--new-tokens` tokens per row
from random-token prompts of `--prompt-len`, bf16 on CUDA. Modes: `eager` (live fp32 weights under bf16
autocast, no graph: what a run without graphs does), `graph` (bf16 replica, decode step in a CUDA graph),
`compile` (the same after torch.compile). `hf` is transformers' generate with its dynamic KV cache on a
bf16 copy of the same weights (SDPA attention). The bound: per decode step the bytes that must be read
(every bf16 matrix once, B embedding rows, the KV cache filled so far, read once) plus the new keys and
values written, over the copy bandwidth measured in this run (bytes read + written per second).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastlm.run_config.schema import RunConfig  # noqa: E402 - after the path fix
from fastlm.generation import Generator, SamplingOptions  # noqa: E402
from fastlm.models.decoder import DecoderLM, build_model  # noqa: E402


@dataclass
class Row:
    preset: str
    mode: str
    batch: int
    prompt_len: int
    new_tokens: int
    seconds: float
    tokens_per_second: float
    setup_seconds: float  # first call: replica, graph capture, compile (not in `seconds`)
    bound_tokens_per_second: float
    fraction_of_bound: float


class _NoTokenizer:
    pad_id = 0
    eos_id = None


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


def bound_seconds(model: DecoderLM, batch: int, prompt_len: int, new_tokens: int, bandwidth: float) -> float:
    """Sum over decode steps of (bf16 matrices + B embedding rows + filled KV cache read + new KV written) / bw."""
    config = model.config
    matrices = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith("embeddings."))
    if config.tie_embeddings:
        matrices += model.output_weight.numel()
    weight_bytes = 2 * matrices + 2 * batch * config.hidden_size
    kv_heads = config.num_heads if model.is_gpt2 else config.kv_heads
    kv_per_token = 2 * config.num_layers * kv_heads * config.head_dim * 2  # keys + values, bf16
    total = 0.0
    for step in range(new_tokens - 1):  # the first new token comes from the prefill
        filled = prompt_len + step + 1
        total += (weight_bytes + batch * kv_per_token * (filled + 1)) / bandwidth
    return total


def time_ours(model: DecoderLM, prompts: list[list[int]], options: SamplingOptions, mode: str,
              repeats: int) -> tuple[float, float]:
    """(median seconds of `repeats` generate calls, seconds of the first call)."""
    generator = Generator(model, _NoTokenizer(), torch.bfloat16, cuda_graph=mode != "eager", compile=mode == "compile")
    seed = torch.Generator(device=model.output_weight.device).manual_seed(0)
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

    from fastlm.models.hf import export_hf

    with tempfile.TemporaryDirectory() as directory:
        started = time.perf_counter()
        export_hf(model, directory)
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


def decode_profile(model: DecoderLM, prompts: list[list[int]], options: SamplingOptions, out: Path | None) -> str:
    """Graph path: per-step GPU time of the captured decode step, and torch.profiler's top kernels of one replay."""
    generator = Generator(model, _NoTokenizer(), torch.bfloat16, cuda_graph=True)
    generator.generate(prompts, SamplingOptions(2, stop_tokens=()))
    (step,) = generator._steps.values()
    assert step.graph is not None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        step.graph.replay()
    end.record()
    end.synchronize()
    line = f"decode step (graph replay, B={len(prompts)}, cache {step.cache.length}): {start.elapsed_time(end) / 50:.3f} ms"
    if out is not None:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step.graph.replay()
            torch.cuda.synchronize()
        (out / "decode_profile.txt").write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    return line


def cpu_smoke() -> None:
    model = load_model("tiny-llama", torch.device("cpu"))
    prompts = [[1] * 8] * 4
    completions = Generator(model, _NoTokenizer()).generate(prompts, SamplingOptions(6), torch.Generator().manual_seed(0))
    assert [len(c.tokens) for c in completions] == [6] * 4
    print("cpu smoke: 4 x 6 tokens generated")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="llama-350m,llama-1b")
    parser.add_argument("--modes", default="graph,compile,hf", help="any of eager, graph, compile, hf")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="directory for results.json and the decode profile")
    parser.add_argument("--cpu-smoke", action="store_true")
    args = parser.parse_args()
    if args.cpu_smoke:
        cpu_smoke()
        return
    if not torch.cuda.is_available():
        sys.exit("bench_rollouts needs a CUDA device (or --cpu-smoke)")
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | copy bandwidth {bandwidth / 1e12:.2f} TB/s",
          flush=True)
    rows: list[Row] = []
    rng = torch.Generator().manual_seed(1)
    for preset in args.presets.split(","):
        model = load_model(preset, device)
        prompts = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt_len), generator=rng).tolist()
        options = SamplingOptions(args.new_tokens, temperature=1.0)
        bound = bound_seconds(model, args.batch, args.prompt_len, args.new_tokens, bandwidth)
        new = args.batch * args.new_tokens
        if "graph" in args.modes.split(","):
            print(decode_profile(model, prompts, options, args.out), flush=True)
        for mode in args.modes.split(","):
            if mode == "hf":
                seconds, setup = time_hf(model, prompts, args.new_tokens)
            else:
                seconds, setup = time_ours(model, prompts, options, mode, 0 if mode == "eager" else args.repeats)
            row = Row(preset, mode, args.batch, args.prompt_len, args.new_tokens, seconds, new / seconds, setup,
                      new / bound, bound / seconds)
            rows.append(row)
            print(json.dumps(asdict(row)), flush=True)
        del model
        torch.cuda.empty_cache()
    print(f"\n| preset | mode | new tokens/s | vs hf | bound tokens/s | of bound | first call s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        hf = next((r for r in rows if r.preset == row.preset and r.mode == "hf"), None)
        ratio = f"{row.tokens_per_second / hf.tokens_per_second:.1f}x" if hf else "-"
        print(f"| {row.preset} | {row.mode} | {row.tokens_per_second:,.0f} | {ratio} | "
              f"{row.bound_tokens_per_second:,.0f} | {row.fraction_of_bound:.0%} | {row.setup_seconds:.1f} |")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_rollouts.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
