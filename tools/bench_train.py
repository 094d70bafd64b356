"""Training throughput and MFU of the model presets, Triton loss against the compiled loss, in one run.

    python tools/bench_train.py                      # CUDA: llama-350m and llama-1b, seq 2048, bf16
    python tools/bench_train.py --packed --compile-model   # + packed ~300-token documents, + compiled blocks
    python tools/bench_train.py --variants packed packed+dense packed+compile packed+compile+ac
    python tools/bench_train.py --cpu-smoke          # CPU: the tiny preset, two steps (CI smoke test)
    python tools/bench_train.py --compare-cli --presets llama-350m --batch 8   # the CLI trainer's gap, taken apart
    python tools/bench_train.py --compare-cli --cpu-smoke                     # the same at a tiny CPU shape
    python tools/bench_train.py --presets llama-1b --batch 4 --losses triton --logits-memory-mib 0 1024
                                                     # the full-logits head against the chunked head
    python tools/bench_train.py --presets qwen3-0.6b llama3.2-1b --batch 1 1 --seq-len 8192 --packed \
        --compile-model --hf                         # + transformers' own model class on the same weights
    python tools/bench_train.py --cpu-smoke --hf     # the same side by side at the tiny CPU shape
    python tools/bench_train.py --presets qwen3.5-0.8b qwen3.5-2b --batch 1 1 --seq-len 8192 --variants packed \
        packed+compile --hf                          # the hybrid (Gated DeltaNet: fla-core's kernels when installed)
    python tools/bench_train.py --cpu-smoke --smoke-preset qwen3.5-tiny --hf   # its CPU smoke
    python tools/bench_train.py --lora --presets llama-1b --batch 4 --lora-seq-len 2048 8192
                                                     # full fine-tune vs LoRA (+ac) vs HF PEFT (tools/bench_lora.py)
    python tools/bench_train.py --long --hf         # 32k-128k tokens with tiling/offload (tools/bench_long.py)

A step is what the trainer does: bf16 autocast forward with the fused loss, backward, fused AdamW; the
variants add packed documents (the trainer's real rows: FlexAttention on CUDA), compiled blocks
(`trainer.compile`, the LM head opaque) and activation checkpointing (`trainer.activation_checkpointing`).

MFU = model_flops_per_token(config, span) * tokens/s / peak, with the peak measured in the same
run as an 8192^3 bf16 matmul (so the ratio does not depend on a datasheet number); span is the row
(seq_len) for plain rows and, for packed rows, the token-weighted document length sum(L^2) / sum(L): the
attention a document mask leaves is the useful work, for fastlm's rows and transformers' alike.

`--hf` times, after each fastlm row and on the same weights (copied through the HF export's weight
rules), transformers' own model class for the family (`AutoModelForCausalLM` from the exported
config.json, SDPA attention): the same bf16 autocast over fp32 weights and fused AdamW, the same rows
(packed rows get per-document position_ids; SDPA then attends over the whole row, more work than fastlm's
document masks, which MFU does not count), decoder layers compiled one by one for +compile and non-reentrant
gradient checkpointing for +ac. Its loss is Liger's fused linear cross-entropy on the final hidden states
when `liger_kernel` imports, else transformers' own (full logits); the row's loss column says which. The
fastlm rows then train cross-entropy only (no z-loss), as the transformers rows do. A transformers row
that runs out of memory is reported as such.

`--compare-cli` (tools/compare_cli.py) times the real `Trainer` (what `fastlm train` runs: data loader,
grad clipping, checks, logging) against this loop at the same shape in one process, and takes the gap
apart: this loop on synthetic rows and on the CLI loader's batches, the trainer's step without and with
read points, `fastlm train` itself, this loop again last (GPU drift), a profile of device busy time, and
the difference of the two setups as built.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from train_loops import (  # noqa: E402
    DOC_MAX,
    DOC_MIN,
    HFLoop,
    Loop,
    attention_span,
    liger_loss,
    measured_peak_flops,
    parse_variant,
    synthetic_batches,
    time_steps,
)

from fastlm.models import build_model, count_parameters, model_flops_per_token  # noqa: E402


@dataclass
class Row:
    preset: str
    loss: str
    variant: str  # plain / packed, +compile (blocks compiled like trainer.compile), +ac (activation checkpointing)
    attention: str  # the layout the rows took: causal, flex or dense
    parameters: int
    batch: int
    seq_len: int
    step_ms: float
    tokens_per_second: float
    mfu: float
    peak_memory_gib: float
    note: str = ""
    head: str = "chunked"  # the LM head: chunked (logits_memory_mib > 0, the default) or full logits


def bench(preset: str, loss: str, variant: str, batch: int, seq_len: int, steps: int, warmup: int,
          device: torch.device, peak: float, vocab_override: int | None = None,
          logits_memory_mib: float | None = None, hf: bool = False) -> list[Row]:
    """fastlm's row, then (with `hf`) transformers' row on the same weights, each alone on the device."""
    loop = Loop(preset, loss, variant, device, vocab_override, logits_memory_mib, z_loss=not hf)
    config = loop.config
    batches = synthetic_batches(config.model.vocab_size, batch, seq_len, loop.packed, device)
    flops = model_flops_per_token(config.model, attention_span(batches[0], seq_len))
    parameters = count_parameters(loop.model)

    def row(name: str, attention: str, seconds: float, memory: float, note: str, head: str) -> Row:
        tokens_per_second = batch * seq_len / seconds
        return Row(preset, name, variant, attention, parameters, batch, seq_len, seconds * 1e3,
                   tokens_per_second, flops * tokens_per_second / peak, memory, note, head)

    seconds, memory = time_steps(loop, batches, steps, warmup, device)
    rows = [row(loss, loop.attention(batches[0]), seconds, memory, loop.fallback.note or "", loop.head())]
    if hf:
        weights = build_model(config.model, device="meta").to_empty(device="cpu")
        weights.load_state_dict({name: value.detach().cpu() for name, value in loop.model.state_dict().items()})
        loop.model = weights  # frees the device copy before transformers' model is built
        del loop.optimizer, loop.fallback
        _free(device)
        try:
            reference = HFLoop(weights, variant, device)
            seconds, memory = time_steps(reference, batches, steps, warmup, device)
            rows.append(row(reference.loss_name, "sdpa causal", seconds, memory, "", "full logits" if reference.liger
                            is None else "liger fused linear CE"))
            del reference
        except torch.OutOfMemoryError:
            rows.append(Row(preset, "transformers", variant, "sdpa causal", parameters, batch, seq_len,
                            float("nan"), 0.0, 0.0, float("nan"), "out of memory"))
    del loop, batches
    _free(device)
    return rows


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def table(rows: list[Row], peak: float, device_name: str) -> str:
    lines = [
        f"device: {device_name}; measured matmul peak {peak / 1e12:.1f} TFLOP/s; torch {torch.__version__}",
        "| preset | loss | variant | attention | params | batch x seq | step ms | tokens/s | MFU | peak mem GiB | head |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.preset} | {r.loss} | {r.variant} | {r.attention} | {r.parameters / 1e6:.0f}M | {r.batch}x{r.seq_len} "
            f"| {r.step_ms:.1f} | {r.tokens_per_second:,.0f} | {r.mfu:.1%} | {r.peak_memory_gib:.1f} | {r.head} |"
        )
        if r.note:
            lines.append(f"note ({r.preset} {r.loss} {r.variant}): {r.note}")
    return "\n".join(lines)


def side_by_side(rows: list[Row]) -> str:
    """fastlm / transformers per preset and variant: the tokens/s ratio and the peak memory of each."""
    import transformers

    liger = "present" if liger_loss() is not None else "absent (transformers rows use their own loss)"
    lines = [f"transformers {transformers.__version__}; liger_kernel {liger}",
             ("| preset | variant | fastlm loss | fastlm tokens/s | transformers tokens/s | speedup | "
              "fastlm peak GiB | transformers peak GiB |"), "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for ours, theirs in zip(rows[::2], rows[1::2]):
        speedup = ours.tokens_per_second / theirs.tokens_per_second if theirs.tokens_per_second else float("nan")
        lines.append(f"| {ours.preset} | {ours.variant} | {ours.loss} | {ours.tokens_per_second:,.0f} | "
                     f"{theirs.tokens_per_second:,.0f} {theirs.note} | {speedup:.2f}x | {ours.peak_memory_gib:.1f} | "
                     f"{theirs.peak_memory_gib:.1f} |")
    return "\n".join(lines)


def variants(args: argparse.Namespace) -> list[str]:
    """--variants as given, else the cross product of the flags (plain always; --packed adds packed rows)."""
    if args.variants:
        for variant in args.variants:
            parse_variant(variant)
        return args.variants
    result = ["plain"] + (["packed"] if args.packed else [])
    if args.compile_model:
        result += [("compile" if v == "plain" else f"{v}+compile") for v in result]
    if args.activation_checkpointing:
        result += [("ac" if v == "plain" else f"{v}+ac") for v in result]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny preset on CPU, two steps, plain and packed")
    parser.add_argument("--presets", nargs="+", default=["llama-350m", "llama-1b"])
    parser.add_argument("--smoke-preset", default="tiny-llama", help="the --cpu-smoke preset (qwen3.5-tiny: the hybrid)")
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 4], help="micro-batch per preset")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--losses", nargs="+", choices=["triton", "compiled"], default=["triton", "compiled"])
    parser.add_argument("--packed", action="store_true", help=f"also time packed rows ({DOC_MIN}-{DOC_MAX}-token documents)")
    parser.add_argument("--compile-model", action="store_true", help="also time compiled blocks (trainer.compile)")
    parser.add_argument("--activation-checkpointing", action="store_true", help="also time with activation checkpointing")
    parser.add_argument("--variants", nargs="+", help="explicit list, e.g. plain packed packed+compile packed+dense")
    parser.add_argument("--compare-cli", action="store_true",
                        help="the CLI trainer (fastlm.engine.trainer.Trainer) against this loop at the same shape")
    parser.add_argument("--cli-steps", type=int, default=40, help="--compare-cli: the trainer's steps")
    parser.add_argument("--log-every", type=int, default=10, help="--compare-cli: trainer.log_every (its tokens/s window)")
    parser.add_argument("--profile-steps", type=int, default=3, help="--compare-cli: steps under torch.profiler per setup")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="--compare-cli: seconds; later sections are skipped near it and the report still prints")
    parser.add_argument("--logits-memory-mib", type=float, nargs="+", default=[None],
                        help="model.head.logits_memory_mib per row (0: the full-logits head); default: the config's")
    parser.add_argument("--vocab", type=int, default=None, help="override the presets' vocab_size (e.g. 128256)")
    parser.add_argument("--hf", action="store_true",
                        help="also time transformers' own model class on the same weights (see the module docstring)")
    parser.add_argument("--lora", action="store_true", help="full fine-tune vs LoRA vs LoRA+ac vs HF PEFT (tools/bench_lora.py)")
    parser.add_argument("--long", action="store_true", help="32k-128k-token steps with the memory savers (tools/bench_long.py)")
    parser.add_argument("--long-seq-len", type=int, nargs="+", default=[32768, 65536, 131072], help="--long: sequence lengths")
    parser.add_argument("--long-setups", nargs="+", help="--long: setups (default: every full fine-tune or LoRA setup)")
    parser.add_argument("--long-steps", type=int, default=2, help="--long: timed steps per row (after one warm-up step)")
    parser.add_argument("--lora-rank", type=int, default=16, help="--lora: the adapters' rank (alpha = 2 * rank)")
    parser.add_argument("--lora-seq-len", type=int, nargs="+", default=[2048, 8192], help="--lora: sequence lengths")
    args = parser.parse_args()
    if args.lora:
        from bench_lora import lora_main  # tools/bench_lora.py

        return lora_main(args)
    if args.long:
        from bench_long import long_main  # tools/bench_long.py

        return long_main(args)
    if args.compare_cli:
        from compare_cli import compare_main  # tools/compare_cli.py: the trainer beside this loop, the gap taken apart

        return compare_main(args)
    if args.cpu_smoke:
        device, presets, batches, seq_len, steps, warmup, losses = (
            torch.device("cpu"), [args.smoke_preset], [2], 32, 2, 1, ["compiled"])
        chosen = ["plain", "packed"]
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA device; use --cpu-smoke on CPU", file=sys.stderr)
            return 2
        device, presets, batches, seq_len, steps, warmup, losses = (
            torch.device("cuda"), args.presets, args.batch, args.seq_len, args.steps, 3, args.losses)
        chosen = variants(args)
    peak = measured_peak_flops(device)
    rows = []
    for preset, batch in zip(presets, batches * len(presets)):
        for loss in losses:
            for variant in chosen:
                for budget in args.logits_memory_mib:
                    new = bench(preset, loss, variant, batch, seq_len, steps, warmup, device, peak, args.vocab, budget,
                                args.hf)
                    rows += new
                    print("\n".join(map(str, new)), flush=True)
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(table(rows, peak, device_name))
    if args.hf:
        print(side_by_side(rows))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_train.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
