"""`bench_train.py --compare-cli`: the CLI trainer against bench_train's loop at one shape, the gap taken apart.

Rows, in one process and this order, each timed over the same number of steps as the CLI's timed windows
(`--cli-steps` less the first `--log-every` window), in windows of `--log-every` steps:

  A  bench_train's loop on its synthetic packed rows (two batches alternating): the reference.
  B  the same loop and model fed the CLI data loader's own batches, already on the device:
     B - A is the data (real documents: other block masks, token ids, label counts).
  C  the real `Trainer.train_step` (built from the CLI config) with no read point inside the timed steps:
     C - B is the trainer's own per-step work (host batch building and checks, pinned copies, the gradient
     norm and clipping, the device-side checks and skip, the schedule).
  D  the same Trainer with a log read point every `--log-every` steps, as `fastlm train` has them (read
     late on CUDA: the host queues the next step before it waits): D - C is the read points.
  E  `fastlm train` itself (`Trainer.train`), its logged `train/tokens_per_second` windows, the first
     (compilation) left out: the goal's number. E - D is logging, the loop and its wall-clock measurement.
  F  A's loop again on a fresh model, last: F - A is the GPU drifting over the run (clocks, power, heat).

A-D and F are timed on the device's timeline (CUDA events: nothing waits inside a row), E by the trainer's
host clock. Each row carries the mean SM clock and power nvidia-smi sampled while it ran, the graphs dynamo
compiled during its timed steps (should be 0) and its peak memory. Then a torch.profiler pass over a few
steps of A, B and C gives device busy time against wall time per step and the kernels whose time changed
most, and the two setups as built (model, head, optimizer, clipping, schedule, compile, attention, dtypes,
batches) are diffed.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import random
import statistics
import string
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import train_loops
from torch._dynamo.utils import counters
from train_loops import DOC_MAX, DOC_MIN, Loop, StepBatch, measured_peak_flops, synthetic_batches

from fastlm.data.batch import Batch
from fastlm.data.eval_source import build_loaders
from fastlm.data.tokenizer import build_tokenizer
from fastlm.engine.optim import fused_update
from fastlm.engine.trainer import Trainer
from fastlm.layers.embedding import document_positions
from fastlm.layers.packed_attention import attention_layout
from fastlm.logging.jsonl import read_metrics
from fastlm.losses.spec import IGNORE_INDEX
from fastlm.models import model_flops_per_token
from fastlm.models.decoder import DecoderLM
from fastlm.run_config.schema import RunConfig

sys.path.insert(0, str(Path(__file__).resolve().parent / "profile"))  # the clock sampler and trace reader
from gpu_clocks import ClockMean, ClockSampler  # noqa: E402
from kernel_trace import TraceSummary, differences_table, profile_steps, profile_table  # noqa: E402

WARMUP = 3  # untimed steps before a row (compilation, optimizer state, pinned buffers)
NEVER = 10**9  # trainer.steps / log_every of the Trainer of row C: no read point of its own


@dataclass
class GapRow:
    name: str
    runs: str
    windows: list[float]  # tokens/s per timed window
    clock: ClockMean | None
    compiled_graphs: int  # by dynamo during the timed steps
    peak_memory_gib: float

    @property
    def tokens_per_second(self) -> float:
        return statistics.mean(self.windows)


@dataclass
class Shape:
    preset: str
    loss: str
    variant: str  # bench_train's variant of rows A, B, F
    batch: int
    seq_len: int
    cli_steps: int
    window: int
    profile_steps: int
    device: torch.device

    @property
    def timed_steps(self) -> int:
        return self.cli_steps - self.window

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len


# --- the CLI's run ------------------------------------------------------------------------------------------
def write_corpus(path: Path, documents: int, seed: int) -> None:
    """Blank-line-separated documents that the byte tokenizer turns into DOC_MIN-DOC_MAX tokens (with
    BOS and EOS), lengths uniform like bench_train's packed rows: random words of lowercase letters."""
    rng = random.Random(seed)
    with path.open("w", encoding="ascii") as handle:
        for _ in range(documents):
            handle.write(_words(rng, rng.randint(DOC_MIN, DOC_MAX) - 2) + "\n\n")


def _words(rng: random.Random, length: int) -> str:
    """Exactly `length` characters of lowercase words, without a space at either end."""
    words: list[str] = []
    while sum(len(word) + 1 for word in words) < length:
        words.append("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))))
    return " ".join(words)[:length].rstrip().ljust(length, "x")


def cli_config(shape: Shape, steps: int, log_every: int, corpus: Path, runs: Path) -> RunConfig:
    """What `fastlm train` would run at the loop's shape: same model and losses, packed text documents."""
    return RunConfig.model_validate({
        "model": train_loops.model_config(shape.preset, shape.loss, None).model.model_dump(mode="json"),
        "run": {"name": f"compare-{shape.preset}", "output_dir": str(runs / "{name}"), "overwrite": True},
        "data": {"source": {"type": "text", "path": str(corpus)}, "seq_len": shape.seq_len,
                 "micro_batch_size": shape.batch, "eval_fraction": 0.0},
        "trainer": {"steps": steps, "log_every": log_every, "eval_every": 0, "checkpoint_every": 0,
                    "device": shape.device.type},
        "logging": {"wandb": {"enabled": False}},  # the progress line shows each window as it is logged
    })


def loader_batches(config: RunConfig, count: int, device: torch.device) -> list[StepBatch]:
    """The first `count` batches of the CLI's train loader (what E trains on), on the device."""
    tokenizer = build_tokenizer(config.data.tokenizer, config.run.init_path)
    train, _ = build_loaders(config.data, config.run.seed, tokenizer)
    return [step_batch(train.next_batch(), device) for _ in range(count)]


def step_batch(batch: Batch, device: torch.device) -> StepBatch:
    moved = batch.to(device)
    return StepBatch(moved.input_ids, moved.labels.reshape(-1), moved.document_ids, float(batch.num_tokens))


# --- timing -------------------------------------------------------------------------------------------------
def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _mark(device: torch.device) -> torch.cuda.Event | float:
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _seconds(start: torch.cuda.Event | float, end: torch.cuda.Event | float) -> float:
    return start.elapsed_time(end) / 1e3 if isinstance(start, torch.cuda.Event) else end - start


def timed_windows(step: Callable[[int], None], shape: Shape) -> list[float]:
    """tokens/s of each window of steps on the device's timeline (CUDA events; the host clock on CPU)."""
    marks = [_mark(shape.device)]
    for index in range(shape.timed_steps):
        step(index)
        if (index + 1) % shape.window == 0:
            marks.append(_mark(shape.device))
    _synchronize(shape.device)
    return [shape.tokens_per_step * shape.window / _seconds(a, b) for a, b in itertools.pairwise(marks)]


class RowTimer:
    """nvidia-smi samples, dynamo compilations and peak memory around a row's timed steps."""

    def __init__(self, sampler: ClockSampler, device: torch.device) -> None:
        self.sampler = sampler
        self.device = device

    def run(self, name: str, runs: str, timed: Callable[[], list[float]]) -> GapRow:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        graphs = counters["stats"]["unique_graphs"]
        start = time.monotonic()
        windows = timed()
        end = time.monotonic()
        memory = torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else 0.0
        row = GapRow(name, runs, windows, self.sampler.mean(start, end),
                     counters["stats"]["unique_graphs"] - graphs, memory)
        print(f"row {name} ({runs}): " + " / ".join(f"{w:,.0f}" for w in windows) + " tokens/s", flush=True)
        return row


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --- the setups as built ------------------------------------------------------------------------------------
def _flat(prefix: str, value: object) -> dict[str, str]:
    if isinstance(value, dict):
        return {key: text for name, item in value.items() for key, text in _flat(f"{prefix}.{name}", item).items()}
    return {prefix: str(value)}


def batch_facts(batches: list[StepBatch], model: DecoderLM, device: torch.device) -> dict[str, str]:
    first = batches[0]
    rows, seq_len = first.input_ids.shape
    pieces = [int((document_positions(b.documents) == 0).sum()) for b in batches if b.documents is not None]
    distinct = torch.unique(torch.cat([b.input_ids.reshape(-1) for b in batches]))
    positions = None if first.documents is None else document_positions(first.documents)
    window = getattr(model.config, "sliding_window", None)
    layout = model.attention_kind or attention_layout(rows, seq_len, positions, window, device,
                                                      head_dim=model.config.head_dim).kind
    masked = [int((b.labels == IGNORE_INDEX).sum()) for b in batches]
    return {
        "batch shape": f"{rows} x {seq_len}",
        "dtypes (ids, labels, documents)": f"{first.input_ids.dtype}, {first.labels.dtype}, "
                                            f"{None if first.documents is None else first.documents.dtype}",
        "distinct token ids in the batches": str(distinct.numel()),
        "masked labels per batch (mean)": f"{statistics.mean(masked):.1f}",
        "document pieces per row (mean)": f"{statistics.mean(pieces) / rows:.2f}" if pieces else "none",
        "attention layout": layout,
    }


def setup_facts(model: DecoderLM, optimizer: torch.optim.Optimizer, amp: torch.dtype | None, batches: list[StepBatch],
                device: torch.device, step_work: dict[str, str]) -> dict[str, str]:
    """What a step runs, read from the live objects: model config, blocks, head, optimizer, precision, batches."""
    first = batches[0].input_ids
    facts = _flat("model", model.config.model_dump(mode="json"))
    facts |= {
        "blocks compiled": str(model.blocks_compiled),
        "activation checkpointing": str(any(block.activation_checkpointing for block in model.blocks)),
        "model.training": str(model.training),
        "loss implementation": str(model.head.implementation),
        "head": model.head.describe(first.numel(), model.config.vocab_size, amp or torch.float32),
        "autocast": str(amp),
        "optimizer": type(optimizer).__name__ + " " + ", ".join(
            f"{key}={optimizer.defaults.get(key)}" for key in ("betas", "eps", "fused", "foreach", "capturable")),
        "parameter groups (tensors, weight decay)": ", ".join(
            f"({len(group['params'])}, {group['weight_decay']})" for group in optimizer.param_groups),
        **batch_facts(batches, model, device),
        **step_work,
    }
    return facts


def bench_step_work(loop: Loop) -> dict[str, str]:
    return {
        "learning rate": f"constant {loop.optimizer.param_groups[0]['lr']:g}",
        "gradient clipping": "none (no gradient norm)",
        "loss normalizers": "tokens",
        "per-step checks": "none",
        "read-backs": "each step: the head's value-check counts at the end of its forward",
    }


def trainer_step_work(trainer: Trainer) -> dict[str, str]:
    config = trainer.config
    clip = config.optimizer.grad_clip
    fused = fused_update(trainer.optimizer)
    schedule = config.schedule
    return {
        "learning rate": f"peak {config.optimizer.lr:g}, warmup {schedule.warmup_steps}, {schedule.decay} "
                         f"to {schedule.min_lr_ratio:g} over trainer.steps",
        "gradient clipping": f"{clip}: norm over all gradients, then "
                             + ("the divisor inside fused AdamW (grad_scale)" if fused else "clip_grad_norm_ in place")
        if clip is not None else "none (the norm is still computed and logged)",
        "loss normalizers": "tokens, documents, micro_batches",
        "per-step checks": "token ids on the host; loss-input checks and the non-finite skip on the device (found_inf)",
        "read-backs": "none inside a step (value checks collected, grad_output applied on the device); every "
                      "pending step's scalars at read points, " + ("late at log-only ones" if trainer.runner.late_reads
                                                                    else "on time"),
    }


def facts_diff(bench: dict[str, str], trainer: dict[str, str]) -> str:
    keys = list(dict.fromkeys([*bench, *trainer]))
    differ = [key for key in keys if bench.get(key) != trainer.get(key)]
    alike = [key for key in keys if key not in differ]
    model_keys = [key for key in alike if key.startswith("model.")]
    lines = ["setup differences (bench loop | trainer):"]
    lines += [f"  {key}: {bench.get(key, '-')} | {trainer.get(key, '-')}" for key in differ] or ["  none"]
    named = [key for key in alike if not key.startswith("model.")]
    lines.append(f"alike: the model config ({len(model_keys)} fields), " + "; ".join(
        f"{key} = {bench[key]}" for key in named))
    return "\n".join(lines)


# --- the rows -----------------------------------------------------------------------------------------------
@dataclass
class Decomposition:
    shape: Shape
    peak: float
    rows: list[GapRow]
    profiles: list[TraceSummary]
    facts: tuple[dict[str, str], dict[str, str]] | None

    def row(self, name: str) -> GapRow | None:
        return next((row for row in self.rows if row.name == name), None)


def _section(title: str, failures: list[str], body: Callable[[], None]) -> None:
    """One part of the decomposition: a failure prints its traceback and the next part still runs."""
    start = time.perf_counter()
    try:
        body()
    except Exception:  # noqa: BLE001 - a GPU run must keep the other measurements
        failures.append(title)
        print(f"section {title!r} failed:\n{traceback.format_exc()}", flush=True)
    print(f"[{title}: {time.perf_counter() - start:.1f} s]", flush=True)


def decompose(shape: Shape, peak: float, sampler: ClockSampler, deadline: float) -> tuple[Decomposition, list[str]]:
    """Rows A-F, the profiles and the setups; a section starts only while `deadline` (`time.monotonic()`)
    leaves it the time it needs, so a time-boxed run still prints its report."""
    device = shape.device
    timer = RowTimer(sampler, device)
    result = Decomposition(shape, peak, [], [], None)
    failures: list[str] = []
    facts: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory(prefix="fastlm-compare-") as folder:
        corpus = Path(folder, "corpus.txt")
        # E's steps, or those of C and D's trainer
        steps = max(shape.cli_steps, WARMUP + 2 * shape.timed_steps + shape.profile_steps)
        needed = steps * shape.batch * (shape.seq_len + 1)  # tokens: no row wraps around the corpus
        write_corpus(corpus, needed // ((DOC_MIN + DOC_MAX) // 2) + 1, seed=0)
        runs = Path(folder, "runs")

        def profile(label: str, step: Callable[[int], None]) -> None:
            """A profiler failure (CUPTI in a container, say) loses the profile, not the rest of the section."""
            _section(f"profile {label}", failures, lambda: result.profiles.append(
                profile_steps(label, step, shape.profile_steps, device)))
        real = cli_config(shape, shape.cli_steps, shape.window, corpus, runs)
        quiet = cli_config(shape, NEVER, NEVER, corpus, runs)

        def bench_rows() -> None:
            loop = Loop(shape.preset, shape.loss, shape.variant, device)
            synthetic = synthetic_batches(loop.config.model.vocab_size, shape.batch, shape.seq_len, loop.packed, device)
            own = loader_batches(real, shape.timed_steps, device)
            for index in range(WARMUP):
                loop.step(synthetic[index % 2])
            result.rows.append(timer.run("A", "bench loop, synthetic rows", lambda: timed_windows(
                lambda i: loop.step(synthetic[i % 2]), shape)))
            loop.step(own[0])  # any recompilation for the new batches happens here
            result.rows.append(timer.run("B", "bench loop, the CLI loader's batches", lambda: timed_windows(
                lambda i: loop.step(own[i]), shape)))
            profile("A bench", lambda i: loop.step(synthetic[i % 2]))
            profile("B bench+CLI data", lambda i: loop.step(own[i]))
            facts["bench"] = setup_facts(loop.model, loop.optimizer, loop.amp, synthetic, device, bench_step_work(loop))

        def trainer_rows() -> None:
            trainer = Trainer(quiet)
            for _ in range(WARMUP):
                trainer.train_step()
            trainer.runner.settle()
            result.rows.append(timer.run("C", "Trainer.train_step, no read point", lambda: timed_windows(
                lambda i: trainer.train_step(), shape)))
            trainer.runner.settle()
            trainer.config.trainer.log_every = shape.window  # its own read points from here on, as the CLI's
            late = "late" if trainer.runner.late_reads else "on time"
            result.rows.append(timer.run("D", f"Trainer.train_step, a log read every {shape.window} ({late})",
                                         lambda: timed_windows(lambda i: trainer.train_step(), shape)))
            profile("C trainer", lambda i: trainer.train_step())
            trainer.runner.settle()
            own = loader_batches(real, 2, device)
            facts["trainer"] = setup_facts(trainer.model, trainer.optimizer, trainer.amp_dtype, own, device,
                                           trainer_step_work(trainer))

        def cli_row() -> None:
            spans: list[tuple[float, float]] = []
            row = timer.run("E", "fastlm train (Trainer.train), logged windows", lambda: cli_windows(real, spans))
            row.clock = sampler.mean(*spans[0])  # the timed windows only, not the build and the compilation
            result.rows.append(row)

        def drift_row() -> None:
            loop = Loop(shape.preset, shape.loss, shape.variant, device)
            synthetic = synthetic_batches(loop.config.model.vocab_size, shape.batch, shape.seq_len, loop.packed, device)
            for index in range(WARMUP):
                loop.step(synthetic[index % 2])
            result.rows.append(timer.run("F", "bench loop again, last", lambda: timed_windows(
                lambda i: loop.step(synthetic[i % 2]), shape)))

        sections = (("bench rows A, B", bench_rows, 0.0), ("trainer rows C, D", trainer_rows, 15.0),
                    ("CLI row E", cli_row, 15.0), ("drift row F", drift_row, 8.0))  # seconds each needs (350M, H200)
        for title, body, needs in sections:
            if time.monotonic() > deadline - needs:
                failures.append(f"{title} (skipped: --time-limit reached)")
                continue
            _section(title, failures, body)
            _release(device)
    if "bench" in facts and "trainer" in facts:
        result.facts = (facts["bench"], facts["trainer"])
    return result, failures


def cli_windows(config: RunConfig, spans: list[tuple[float, float]]) -> list[float]:
    """`fastlm train` at this shape: its logged tokens/s per window from metrics.jsonl, the first left out;
    the timed windows' span (`time.monotonic()`, from the records' wall times) is appended to `spans`."""
    summary = Trainer(config).train()
    records = [r for r in read_metrics(summary.run_dir / "metrics.jsonl") if "train/tokens_per_second" in r]
    if len(records) < 2:
        raise SystemExit("--compare-cli needs two log windows or more: raise --cli-steps or lower --log-every")
    offset = time.monotonic() - time.time()
    spans.append((records[0]["time"] + offset, records[-1]["time"] + offset))
    return [r["train/tokens_per_second"] for r in records[1:]]


# --- the report ---------------------------------------------------------------------------------------------
LEGEND = (
    "A: the reference",
    "B - A: the data (real documents: block masks, token ids, label counts)",
    "C - B: the trainer's own step work (host batch building and checks, copies, gradient norm, clipping, "
    "device checks, schedule)",
    "D - C: read points (the queue drains and restarts)",
    "E - D: logging, the loop and its wall-clock windows; E / A is the goal's ratio (>= 0.95)",
    "F - A: the GPU drifting over the run (same work, later)",
)


def rows_table(result: Decomposition) -> str:
    reference = result.row("A")
    flops = model_flops_per_token(train_loops.model_config(result.shape.preset, result.shape.loss, None).model,
                                  result.shape.seq_len)
    lines = [("| row | runs | tokens/s per window | mean tokens/s | ms/step | MFU | vs A "
              "| graphs compiled (E: whole run) | SM MHz | power W | peak GiB |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in result.rows:
        mean = row.tokens_per_second
        ratio = f"{mean / reference.tokens_per_second:.3f}" if reference else "n/a"
        clock = row.clock
        lines.append(
            f"| {row.name} | {row.runs} | {' / '.join(f'{w:,.0f}' for w in row.windows)} | {mean:,.0f} "
            f"| {result.shape.tokens_per_step / mean * 1e3:.1f} | {flops * mean / result.peak:.1%} | {ratio} "
            f"| {row.compiled_graphs} | {f'{clock.sm_mhz:.0f}' if clock else 'n/a'} "
            f"| {f'{clock.power_w:.0f}' if clock else 'n/a'} | {row.peak_memory_gib:.1f} |")
    return "\n".join(lines)


def attribution(result: Decomposition) -> str:
    """E - A split into the steps between rows, in % of A (the differences add up exactly)."""
    means = {row.name: row.tokens_per_second for row in result.rows}
    if "A" not in means:
        return "attribution: row A is missing"
    base = means["A"]
    parts = []
    for before, after, what in (("A", "B", "data"), ("B", "C", "trainer step"), ("C", "D", "read points"),
                                ("D", "E", "logging/loop/measurement")):
        change = f"{(means[after] - means[before]) / base:+.1%}" if before in means and after in means else "n/a"
        parts.append(f"{what} ({after}-{before}) {change}")
    total = f"{(means['E'] - base) / base:+.1%}" if "E" in means else "n/a"
    drift = f"{(means['F'] - base) / base:+.1%}" if "F" in means else "n/a"
    ratios = []
    if "E" in means:
        ratios.append(f"E / A's first window (the old 10-step bench row) {means['E'] / result.row('A').windows[0]:.3f}")
    if "E" in means and "F" in means:  # the bench before and after the CLI: drift cancels to first order
        ratios.append(f"E / mean(A, F) {means['E'] / statistics.mean([base, means['F']]):.3f}")
    return (f"attribution of E - A = {total} of A: " + ", ".join(parts) + f"; drift (F-A) {drift}"
            + "".join(f"; {ratio}" for ratio in ratios))


def report(result: Decomposition, failures: list[str]) -> str:
    shape = result.shape
    device_name = torch.cuda.get_device_name() if shape.device.type == "cuda" else "cpu"
    lines = [
        (f"== CLI gap, {shape.preset} {shape.batch}x{shape.seq_len}, {shape.variant}, {shape.loss} loss: "
         f"{shape.timed_steps} timed steps per row in windows of {shape.window} ({WARMUP} warm-up steps first; E: "
         f"{shape.cli_steps} steps, the first window left out) =="),
        f"device: {device_name}; measured matmul peak {result.peak / 1e12:.1f} TFLOP/s; torch {torch.__version__}",
        rows_table(result),
        *(f"  {line}" for line in LEGEND),
        attribution(result),
    ]
    if result.profiles:
        lines += [f"profile of {shape.profile_steps} steps each (torch.profiler, device activity only):",
                  profile_table(result.profiles)]
        by_label = {summary.label[0]: summary for summary in result.profiles}
        for before, after in (("A", "B"), ("B", "C")):
            if before in by_label and after in by_label:
                lines.append(differences_table(by_label[before], by_label[after]))
    if result.facts is not None:
        lines.append(facts_diff(*result.facts))
    if failures:
        lines.append(f"FAILED sections: {', '.join(failures)} (a failure's traceback is above)")
    return "\n".join(lines)


def compare_main(args: argparse.Namespace) -> int:
    """CUDA at the given presets (packed+compile, the Triton loss), or --cpu-smoke's tiny shape."""
    if args.cpu_smoke:
        device, presets, batches, seq_len = torch.device("cpu"), ["tiny-llama"], [2], 32
        loss, variant = "compiled", "packed"
        cli_steps, window, profiled = 6, 2, 2
    elif not torch.cuda.is_available():
        print("needs a CUDA device; use --cpu-smoke on CPU", file=sys.stderr)
        return 2
    else:
        device, presets, batches, seq_len, loss, variant = (
            torch.device("cuda"), args.presets, args.batch, args.seq_len, "triton", "packed+compile")
        cli_steps, window, profiled = args.cli_steps, args.log_every, args.profile_steps
    if cli_steps % window or cli_steps < 2 * window:
        raise SystemExit(f"--cli-steps ({cli_steps}) must be a multiple of --log-every ({window}), two windows or more")
    deadline = time.monotonic() + (args.time_limit or float("inf"))
    peak = measured_peak_flops(device)
    results = []
    failed = False
    with ClockSampler() as sampler:
        for preset, batch in zip(presets, batches * len(presets)):
            shape = Shape(preset, loss, variant, batch, seq_len, cli_steps, window, profiled, device)
            result, failures = decompose(shape, peak, sampler, deadline)
            print(report(result, failures), flush=True)
            results.append(result)
            failed |= bool(failures)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "compare_cli.json").write_text(json.dumps(
            [{"shape": {**asdict(r.shape), "device": str(r.shape.device)}, "peak": r.peak,
              "rows": [asdict(row) for row in r.rows]} for r in results], indent=1, default=str))
    return 1 if failed else 0
