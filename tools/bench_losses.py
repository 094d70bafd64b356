"""Benchmark forward+gradient of the monolithic LM-head loss, every implementation side by side.

    python tools/bench_losses.py                # H200: all specs x tokens {4096,16384} x vocab {32000,131072}
    python tools/bench_losses.py --tune         # block size x num_warps sweep (CE, CE+z+GRPO; T=16384, V=32000/131072)
    python tools/bench_losses.py --tune --tune-spec ce+kd --tune-prefetch 0 1   # with and without prefetch
    python tools/bench_losses.py --tune --tune-spec ce+kd --tune-split 1 2 4 8 # programs per row
    python tools/bench_losses.py --cpu-smoke    # tiny shapes on CPU (Triton interpreted), a few seconds

Implementations: triton (fresh gradient buffer), triton-deferred (the same inside
`deferred_value_checks()`), triton-inplace (gradient over the logits), triton-kernel (the fused launch
alone: gradient and per-token terms, no validation, reduction or read-back), copy (the R1 bytes through
`copy_`, or `add` with a teacher: what any kernel of the shape can reach), compiled, eager (float32
reference + autograd) and Liger-Kernel's cross entropy (CE and CE+z through lse_square_scale) when
`liger_kernel` imports. Logits are bf16.

Timing: `triton.testing.do_bench` median (CUDA; it also flushes L2 before each call) with the inputs
rotated among two sets; on CPU a perf_counter median. Roofline R1 = bytes of reading the logits once
(and the teacher logits for distillation) + writing the gradient once + the per-token vectors, over
the bandwidth of a device-to-device copy measured in this run (read + write bytes). Peak extra
memory = `torch.cuda.max_memory_allocated` above what was allocated before the call. The last lines
printed are a compact markdown table; the full results go to `$OUT/bench_losses.json` when $OUT is set.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402 - TRITON_INTERPRET must be set (in main) before triton is imported

from fastlm.losses import children as fastlm_children  # noqa: E402
from fastlm.losses.spec import LossNormalizers, LossSpec, LossTargets  # noqa: E402
from fastlm.losses.validation import deferred_value_checks  # noqa: E402


def make_specs(children: ModuleType, spec_class: type) -> dict[str, object]:
    """The benchmarked specs, built from a `fastlm.losses.children` module and its `LossSpec` (this
    tree's, or a baseline's for `--baseline`)."""
    ce, z = children.CrossEntropy("ce", 1.0), children.ZLoss("z", 1e-4)
    grpo = partial(children.GRPO, "grpo", 1.0, eps_low=0.2, eps_high=0.2)
    kd = partial(children.Distillation, "kd", 1.0, temperature=2.0)
    return {
        "ce": spec_class((ce,)),
        "ce+z": spec_class((ce, z)),
        "grpo+z": spec_class((z, grpo())),
        "ce+z+grpo": spec_class((ce, z, grpo())),
        "gspo+z": spec_class((z, children.GSPO("gspo", 1.0, eps_low=3e-4, eps_high=4e-4))),
        "ce+kd": spec_class((ce, kd())),
        # The policy family's options, each next to plain GRPO+z (issue 20: within 5% of it).
        "grpo(seq)+z": spec_class((z, grpo(loss_type="grpo"))),
        "grpo(bnpo)+z": spec_class((z, grpo(loss_type="bnpo"))),
        "grpo(dr)+z": spec_class((z, grpo(loss_type="dr_grpo", max_completion_length=512))),
        "grpo(delta,H)+z": spec_class((z, grpo(delta=3.0, entropy_coeff=1e-3))),
        "grpo(beta)+z": spec_class((z, grpo(beta=0.04))),
        "cispo+z": spec_class((z, children.CISPO("cispo", 1.0))),
        # temperature_mode both (a second, tempered student softmax), next to ce+kd.
        "ce+kd(both)": spec_class((ce, kd(tempered_student=True))),
    }


SPECS: dict[str, LossSpec] = make_specs(fastlm_children, LossSpec)
GPU_SHAPES = [(4096, 32000), (4096, 131072), (16384, 32000), (16384, 131072)]
SMOKE_SHAPES = [(8, 96)]
SETS = 2  # input sets rotated so a small case is not served from L2
LIGER_SPECS = ("ce", "ce+z")
# Small looped blocks are in the sweep on purpose: at V=32000 the rows in flight (132 SMs x a few CTAs
# x 64 KB of bf16) fit in the H200's 60 MB L2, so the second (gradient) pass of a looped kernel may
# re-read from L2 and beat the single 32768 block, which holds the whole row in registers.
TUNE_GRID = {"gpu": ((2048, 4096, 8192, 16384), (4, 8, 16)), "cpu": ((32, 128), (1, 4))}
TUNE_SPECS = ["ce", "ce+z+grpo"]
TUNE_REP_MS = 40  # do_bench time per point: 12 points per (spec, vocab), compiles included, well under a minute


@dataclass
class Case:
    """One input set: bf16 logits (and teacher), labels with 1 in 7 masked, policy inputs, documents."""

    logits: torch.Tensor
    targets: LossTargets
    normalizers: LossNormalizers
    buffer: torch.Tensor | None = None  # a copy of the logits that in-place paths overwrite
    converted: dict[str, tuple] = field(default_factory=dict)  # --baseline: targets, normalizers per tree


def make_case(tokens: int, vocab: int, seed: int, device: torch.device, teacher: bool) -> Case:
    generator = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(tokens, vocab, device=device, generator=generator, dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), device=device, generator=generator)
    labels[seed % 7 :: 7] = -100
    old_logp = -torch.rand(tokens, device=device, generator=generator) * 12.0
    advantages = torch.randn(tokens, device=device, generator=generator)
    document_ids = torch.arange(tokens, device=device) // 512
    teacher_logits = (
        torch.randn(tokens, vocab, device=device, generator=generator, dtype=torch.bfloat16) if teacher else None
    )
    ref_logp = old_logp + 0.1 * torch.randn(tokens, device=device, generator=generator)
    mask = labels != -100
    normalizers = LossNormalizers(float(mask.sum()), float(document_ids[mask].unique().numel()))
    targets = LossTargets(labels, old_logp, advantages, document_ids, teacher_logits, ref_logp=ref_logp)
    return Case(logits, targets, normalizers)


def roofline_bytes(case: Case, spec: LossSpec) -> int:
    """R1 bytes: logits read once + gradient written once (+ teacher read once) + per-token vectors
    (labels, policy inputs, document ids read; lse/new_logp/entropy written)."""
    logits, targets = case.logits, case.targets
    total = 2 * logits.numel() * logits.element_size() + targets.labels.numel() * targets.labels.element_size()
    read = {name for child in spec.children for name in (*child.reads, *getattr(child, "target_names", ()))}
    total += sum(getattr(targets, name).numel() * getattr(targets, name).element_size() for name in sorted(read))
    return total + 3 * 4 * logits.shape[0]


class Bench:
    """Median time and peak extra memory of a zero-argument callable on this device."""

    def __init__(self, device: torch.device, rep_ms: int) -> None:
        self.device = device
        self.rep_ms = rep_ms
        self.tune_blocks, self.tune_warps = TUNE_GRID["gpu" if device.type == "cuda" else "cpu"]

    def time_ms(self, step: Callable[[], object]) -> float:
        if self.device.type == "cuda":
            from triton.testing import do_bench

            return float(do_bench(step, warmup=max(10, self.rep_ms // 4), rep=self.rep_ms, return_mode="median"))
        step()  # warm-up (interpreter / kernel caches)
        samples = []
        for _ in range(2):
            start = time.perf_counter()
            step()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)

    def host_ms(self, step: Callable[[], object], calls: int = 20) -> float:
        """Median host time of one call started on an idle device: what the host spends enqueuing it.
        A call whose host time exceeds its GPU time is host-bound, and `time_ms` then counts the GPU
        waiting (run it inside `deferred_value_checks()`, or the value check's read-back waits too)."""
        samples = []
        for _ in range(calls):
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            samples.append((time.perf_counter() - start) * 1e3)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return statistics.median(samples)

    def peak_mib(self, step: Callable[[], object]) -> float | None:
        """Peak allocation above what was live before one call (None on CPU)."""
        if self.device.type != "cuda":
            return None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        del out
        return peak / 2**20

    def copy_gb_s(self) -> float:
        """Device-to-device copy bandwidth, counting read + write bytes."""
        numel = 2**28 if self.device.type == "cuda" else 2**22
        src = torch.randn(numel, device=self.device, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        ms = self.time_ms(lambda: dst.copy_(src))
        return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def rotating(cases: list[Case], call: Callable[[Case], object]) -> Callable[[], object]:
    """A step that runs `call` on the next input set each time."""
    state = {"i": 0}

    def step() -> object:
        state["i"] += 1
        return call(cases[state["i"] % len(cases)])

    return step


def load_liger() -> tuple[type | None, str]:
    try:
        from liger_kernel.transformers.cross_entropy import LigerCrossEntropyLoss
    except Exception as error:  # noqa: BLE001 - any import failure means "not available", with the reason
        return None, f"{type(error).__name__}: {error}"
    return LigerCrossEntropyLoss, "ok"


def implementations(
    name: str, spec: LossSpec, device: torch.device, liger: type | None, tune: dict[str, int | bool]
) -> dict[str, Callable[[Case], object]]:
    """implementation -> function of one input set doing forward + gradient (returns what it allocated)."""
    from fastlm.losses.compiled import compiled_loss
    from fastlm.losses.reference import reference_loss
    from fastlm.losses.triton.launcher import fused_kernel_only, triton_loss

    def triton(case: Case) -> object:
        return triton_loss(case.logits, case.targets, case.normalizers, spec, **tune)

    def triton_inplace(case: Case) -> object:
        return triton_loss(case.buffer, case.targets, case.normalizers, spec, inplace=True, **tune)

    def triton_kernel(case: Case) -> object:
        return fused_kernel_only(case.buffer, case.targets, case.normalizers, spec, case.buffer, **tune)

    def same_shape_copy(case: Case) -> object:
        """The R1 bytes moved by the plainest torch op, timed the same way: a yardstick for what a
        kernel of this shape can reach (launch, ramp and drain included)."""
        if spec.teacher is not None:
            return torch.add(case.logits, case.targets.teacher_logits, out=case.buffer)
        return case.buffer.copy_(case.logits)

    def compiled(case: Case) -> object:
        return compiled_loss(case.logits, case.targets, case.normalizers, spec)

    def eager(case: Case) -> object:
        z = case.logits.float().requires_grad_()
        reference_loss(z, case.targets, case.normalizers, spec).loss.backward()
        return z.grad

    found: dict[str, Callable[[Case], object]] = {
        "triton": triton, "triton-deferred": triton, "triton-inplace": triton_inplace}
    if not spec.per_document:
        found["triton-kernel"] = triton_kernel
    found["copy"] = same_shape_copy
    found.update(compiled=compiled, eager=eager)
    if liger is not None and device.type == "cuda" and name in LIGER_SPECS:
        # Liger writes the gradient over its input during forward, like triton-inplace.
        z_weight = sum(child.weight for child in spec.children if child.kind == "z_loss")
        module = liger(lse_square_scale=z_weight)

        def liger_step(case: Case) -> object:
            leaf = case.buffer.detach().requires_grad_()
            module(leaf, case.targets.labels).backward()
            return leaf.grad

        found["liger"] = liger_step
    return found


def grad_error(spec: LossSpec, case: Case) -> float:
    """Relative error of the triton gradient against the compiled one on this input set."""
    from fastlm.losses.compiled import compiled_loss
    from fastlm.losses.triton.launcher import triton_loss

    _, grad = triton_loss(case.logits, case.targets, case.normalizers, spec)
    _, expected = compiled_loss(case.logits, case.targets, case.normalizers, spec)
    return float((grad.double() - expected.double()).norm() / expected.double().norm())


def benchmark(
    shapes: list[tuple[int, int]], bench: Bench, copy_gb_s: float, liger: type | None, spec_names: list[str]
) -> list[dict]:
    rows = []
    for tokens, vocab in shapes:
        for name, spec in ((name, SPECS[name]) for name in spec_names):
            cases = [make_case(tokens, vocab, seed, bench.device, spec.teacher is not None) for seed in range(SETS)]
            for case in cases:
                case.buffer = case.logits.clone()
            r1_bytes = roofline_bytes(cases[0], spec)
            r1_ms = r1_bytes / (copy_gb_s * 1e9) * 1e3
            row: dict = {"spec": name, "tokens": tokens, "vocab": vocab, "r1_bytes": r1_bytes, "r1_ms": r1_ms,
                         "grad_rel_err_vs_compiled": grad_error(spec, cases[0]), "ms": {}, "peak_mib": {}}
            for impl, call in implementations(name, spec, bench.device, liger, {}).items():
                try:
                    # "-deferred": the value checks of every timed call are read back after the timing, as
                    # the trainer reads them once per step (validation.deferred_value_checks).
                    with deferred_value_checks() if impl.endswith("-deferred") else nullcontext():
                        row["ms"][impl] = bench.time_ms(rotating(cases, call))
                    row["peak_mib"][impl] = bench.peak_mib(partial(call, cases[0]))
                except torch.cuda.OutOfMemoryError:
                    row["ms"][impl], row["peak_mib"][impl] = None, "oom"
                    torch.cuda.empty_cache()
            ms = row["ms"]
            row["x_r1"] = {impl: t / r1_ms for impl, t in ms.items() if t is not None}
            row["gb_s"] = {impl: r1_bytes / (t * 1e-3) / 1e9 for impl, t in ms.items() if t is not None}
            row["speedup"] = {
                other: ms[other] / ms["triton"]
                for other in ("compiled", "eager", "liger") if ms.get(other) and ms["triton"]
            }
            rows.append(row)
            shown = {k: row[k] for k in ("spec", "tokens", "vocab", "ms", "x_r1")}
            print(json.dumps(shown, default=_round), flush=True)
            del cases
            if bench.device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def tune(
    token_counts: list[int], vocabs: list[int], spec_names: list[str], bench: Bench, copy_gb_s: float,
    prefetches: tuple[bool, ...] | None, splits: tuple[int, ...] | None = None,
) -> list[dict]:
    """Block size x num_warps x prefetch x programs per row (None: each spec's default only) of the
    fused launch alone (`fused_kernel_only`): the host tail is the same at every point, so it would
    only add noise."""
    from fastlm.losses.triton.launcher import default_prefetch, schedule

    rows = []
    for spec_name, tokens, vocab in ((s, t, v) for s in spec_names for t in token_counts for v in vocabs):
        spec = SPECS[spec_name]
        distill = spec.teacher is not None
        cases = [make_case(tokens, vocab, seed, bench.device, distill) for seed in range(SETS)]
        for case in cases:
            case.buffer = case.logits.clone()
        r1_ms = roofline_bytes(cases[0], spec) / (copy_gb_s * 1e9) * 1e3
        default_point = schedule(vocab, distill)
        points = []
        flags = prefetches if prefetches is not None else (default_prefetch(distill),)
        grid = ((b, w, f, s) for b in bench.tune_blocks for w in bench.tune_warps for f in flags
                for s in (splits or (None,)))
        for block, warps, prefetch, split in grid:
            point = schedule(vocab, distill, block, warps, prefetch, split)
            options = {"max_block": block, "num_warps": warps, "prefetch": prefetch, "split": point.split}
            calls = implementations(spec_name, spec, bench.device, None, options)
            kernel = bench.time_ms(rotating(cases, calls["triton-kernel"]))
            points.append({
                "spec": spec_name, "tokens": tokens, "vocab": vocab, "block": point.block, "num_warps": warps,
                "prefetch": prefetch, "split": point.split, "kernel_ms": kernel, "kernel_x_r1": kernel / r1_ms,
                "default": point == default_point, "best_kernel": False,
            })
        min(points, key=lambda p: p["kernel_ms"])["best_kernel"] = True
        rows += points
        del cases
        if bench.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


@dataclass
class Tree:
    """One fastlm tree timed by `--baseline`: this one ("after") or main's copy ("before")."""

    name: str
    launcher: ModuleType
    validation: ModuleType
    spec_module: ModuleType
    specs: dict[str, object]


def load_tree(name: str, package: str) -> Tree:
    """The loss modules of `package` (`fastlm`, or `fastlm_base` from tools/bench/make_baseline.sh)."""
    spec_module = importlib.import_module(f"{package}.losses.spec")
    children = importlib.import_module(f"{package}.losses.children")
    return Tree(name, importlib.import_module(f"{package}.losses.triton.launcher"),
                importlib.import_module(f"{package}.losses.validation"), spec_module,
                make_specs(children, spec_module.LossSpec))


def tree_inputs(tree: Tree, case: Case) -> tuple:
    """The case's targets and normalizers as the tree's own dataclasses (converted once)."""
    if tree.name not in case.converted:
        known = {f.name for f in fields(tree.spec_module.LossTargets)}  # the baseline predates some (teacher_head)
        unset = [f.name for f in fields(case.targets)
                 if f.name not in known and getattr(case.targets, f.name) is not None]
        if unset:
            raise ValueError(f"{tree.name}'s LossTargets has no {unset}")
        targets = tree.spec_module.LossTargets(**{name: getattr(case.targets, name) for name in known})
        normalizers = tree.spec_module.LossNormalizers(**asdict(case.normalizers))
        case.converted[tree.name] = (targets, normalizers)
    return case.converted[tree.name]


def ab_row(trees: list[Tree], name: str, cases: list[Case], bench: Bench) -> dict:
    """Each tree's trainer call (`deferred`: value checks read back after the timing; `host`: the
    host's time to enqueue one such call, `Bench.host_ms`) and fused launch alone (`kernel`, not for
    per-document specs) on the same inputs, and the gradients' relative difference. A tree that
    cannot run the spec gets its error instead of times."""
    found: dict = {}
    grads: dict[str, torch.Tensor] = {}
    for tree in trees:
        spec = tree.specs[name]
        timing: dict = {}
        found[tree.name] = timing

        def call(case: Case, tree: Tree = tree, spec: object = spec) -> object:
            return tree.launcher.triton_loss(case.logits, *tree_inputs(tree, case), spec)

        def kernel(case: Case, tree: Tree = tree, spec: object = spec) -> object:
            return tree.launcher.fused_kernel_only(case.buffer, *tree_inputs(tree, case), spec, case.buffer)

        try:
            grads[tree.name] = call(cases[0])[1]
            with tree.validation.deferred_value_checks():
                timing["deferred"] = bench.time_ms(rotating(cases, call))
                timing["host"] = bench.host_ms(rotating(cases, call))
            if not spec.per_document:
                timing["kernel"] = bench.time_ms(rotating(cases, kernel))
        except Exception as error:  # noqa: BLE001 - one tree's failure is a row's note, not the run's end
            timing["error"] = f"{type(error).__name__}: {error}"[:300]
            print(f"{tree.name} {name}: {timing['error']}", flush=True)
    if len(grads) == 2:
        found["grad_rel_diff"] = rel_diff(*(grads[tree.name] for tree in trees))
    return found


def rel_diff(before: torch.Tensor, after: torch.Tensor, rows: int = 2048) -> float:
    """||after - before|| / ||before||, in float64 a few rows at a time (a 16384 x 131072 pair in
    float64 at once would take 48 GiB)."""
    difference = norm = 0.0
    for start in range(0, before.shape[0], rows):
        b, a = before[start : start + rows].double(), after[start : start + rows].double()
        difference += float((a - b).square().sum())
        norm += float(b.square().sum())
    return (difference / norm) ** 0.5 if norm else float(difference > 0)


def ab_benchmark(shapes: list[tuple[int, int]], bench: Bench, copy_gb_s: float, trees: list[Tree],
                 spec_names: list[str]) -> list[dict]:
    """Before/after of every spec and shape in one process, each row on its own fresh inputs."""
    rows = []
    for tokens, vocab in shapes:
        for name in spec_names:
            row: dict = {"spec": name, "tokens": tokens, "vocab": vocab}
            try:
                teacher = SPECS[name].teacher is not None
                cases = [make_case(tokens, vocab, seed, bench.device, teacher) for seed in range(SETS)]
                for case in cases:
                    case.buffer = case.logits.clone()
                row["r1_ms"] = roofline_bytes(cases[0], SPECS[name]) / (copy_gb_s * 1e9) * 1e3
                row.update(ab_row(trees, name, cases, bench))
                del cases
            except Exception:  # noqa: BLE001 - keep the other rows
                row["error"] = traceback.format_exc()[-600:]
                print(row["error"], flush=True)
            rows.append(row)
            print(json.dumps(row, default=_round), flush=True)
            if bench.device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def ab_table(rows: list[dict]) -> str:
    """Before/after per row; `vs peer` = after's time over the same shape's peer (plain grpo+z, or ce+kd
    for a distillation spec), deferred / kernel; host = the host's time to enqueue the call (a row whose
    host time exceeds its kernels' is host-bound)."""
    timed = {(r["spec"], r["tokens"], r["vocab"]): r for r in rows}
    lines = ["| spec | T | V | R1 ms | deferred before | deferred after | after/before | kernel before | kernel after "
             "| after/before | host before | host after | peer | after vs peer (deferred / kernel) | grad rel diff |",
             "|" + "---|" * 15]

    def ms(row: dict | None, tree: str, column: str) -> float | None:
        return None if row is None else row.get(tree, {}).get(column)

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.3f}" if a and b else "-"

    for row in rows:
        key = (row["tokens"], row["vocab"])
        peer = "ce+kd" if SPECS[row["spec"]].teacher is not None else "grpo+z"
        peer_row = timed.get((peer, *key))
        cells = []
        for column in ("deferred", "kernel"):
            before, after = ms(row, "before", column), ms(row, "after", column)
            cells += [_cell(before), _cell(after), ratio(after, before)]
        cells += [_cell(ms(row, "before", "host")), _cell(ms(row, "after", "host"))]
        versus = " / ".join(ratio(ms(row, "after", c), ms(peer_row, "after", c)) for c in ("deferred", "kernel"))
        diff = row.get("grad_rel_diff")
        r1 = row.get("r1_ms")
        lines.append(f"| {row['spec']} | {row['tokens']} | {row['vocab']} | {_cell(r1)} | " + " | ".join(cells)
                     + f" | {peer} | {versus} | {'-' if diff is None else f'{diff:.1e}'} |")
    notes = [f"{row['spec']} T={row['tokens']} V={row['vocab']} {tree}: {row[tree]['error']}"
             for row in rows for tree in ("before", "after") if "error" in row.get(tree, {})]
    return "\n".join(lines + notes)


def suggest_defaults(rows: list[dict]) -> list[dict]:
    """Per vocab: the (block, num_warps, prefetch, split) with the lowest geometric mean over the swept
    (spec, tokens) of kernel-only time / that case's best kernel-only time (1.0 = best everywhere), next
    to the current default's."""
    suggestions = []
    for vocab in sorted({r["vocab"] for r in rows}):
        timed = [r for r in rows if r["vocab"] == vocab]
        cases = {(r["spec"], r["tokens"]) for r in timed}
        best = {case: min(r["kernel_ms"] for r in timed if (r["spec"], r["tokens"]) == case) for case in cases}
        scores: dict[tuple, list[float]] = {}
        defaults: dict[tuple, bool] = {}
        for r in timed:
            point = (r["block"], r["num_warps"], r["prefetch"], r["split"])
            scores.setdefault(point, []).append(r["kernel_ms"] / best[(r["spec"], r["tokens"])])
            defaults[point] = defaults.get(point, False) or r["default"]
        geo = {p: statistics.geometric_mean(v) for p, v in scores.items() if len(v) == len(best)}
        if not geo:
            continue
        chosen = min(geo, key=geo.get)
        default = next((p for p, is_default in defaults.items() if is_default), None)
        suggestions.append({"vocab": vocab, "block": chosen[0], "num_warps": chosen[1], "prefetch": chosen[2],
                            "split": chosen[3],
                            "score": geo[chosen], "default": default,
                            "default_score": geo.get(default) if default else None,
                            "specs": sorted(f"{spec}@{tokens}" for spec, tokens in best)})
    return suggestions


def _round(value: object) -> object:
    return round(value, 4) if isinstance(value, float) else str(value)


def _cell(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def results_table(rows: list[dict], copy_gb_s: float) -> str:
    """One line per (spec, shape): triton times with x R1, the others, speed-ups, peak memory."""
    impls = ("triton", "triton-deferred", "triton-inplace", "triton-kernel", "copy", "compiled", "eager", "liger")
    lines = [
        f"copy bandwidth {copy_gb_s:.0f} GB/s (read+write); ms = median forward+gradient; (xR1) = time / roofline R1; "
        "same-shape copy = the R1 bytes through copy_ (add with a teacher), timed alike",
        "| spec | T | V | R1 ms | triton | deferred checks | in-place | kernel only | same-shape copy | compiled "
        "| eager | liger | xcomp | xeager | xliger | grad err | peak MiB tri/inp/comp/eager/liger |",
        "|" + "---|" * 17,
    ]
    for row in rows:
        ms, x_r1, speed, peak = row["ms"], row["x_r1"], row["speedup"], row["peak_mib"]
        timed = [f"{_cell(ms.get(i))} ({x_r1[i]:.2f})" if ms.get(i) else "-" for i in impls[:5]]
        timed += [_cell(ms.get(i)) for i in impls[5:]]
        peaks = "/".join(f"{p:.0f}" if isinstance(p, float) else str(p or "-")
                         for p in (peak.get(i) for i in impls if i not in ("triton-kernel", "triton-deferred", "copy")))
        lines.append(
            f"| {row['spec']} | {row['tokens']} | {row['vocab']} | {row['r1_ms']:.3f} | " + " | ".join(timed)
            + " | " + " | ".join(_cell(speed.get(o), 2) for o in ("compiled", "eager", "liger"))
            + f" | {row['grad_rel_err_vs_compiled']:.1e} | {peaks} |"
        )
    return "\n".join(lines)


def tune_table(rows: list[dict], suggestions: list[dict]) -> str:
    """The kernel alone per point (`*` current default, `best` = fastest), then the suggestions."""
    lines = ["| spec | T | V | block | num_warps | prefetch | split | kernel only ms | xR1 | default | best |",
             "|" + "---|" * 11]
    lines += [
        f"| {r['spec']} | {r['tokens']} | {r['vocab']} | {r['block']} | {r['num_warps']} | {int(r['prefetch'])} "
        f"| {r['split']} "
        f"| {r['kernel_ms']:.3f} | {r['kernel_x_r1']:.2f} | {'*' if r['default'] else ''} "
        f"| {'best' if r['best_kernel'] else ''} |"
        for r in rows
    ]
    for pick in suggestions:
        current = ("/".join(map(str, map(int, pick["default"]))) + f" at {pick['default_score']:.3f}"
                   if pick["default"] else "not swept")
        lines.append(
            f"suggested default V={pick['vocab']}: max_block {pick['block']}, num_warps {pick['num_warps']}, "
            f"prefetch {int(pick['prefetch'])}, split {pick['split']} "
            f"(kernel only, geo-mean over {', '.join(pick['specs'])} of time / each case's best: "
            f"{pick['score']:.3f}; current {current})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, Triton interpreted")
    parser.add_argument("--specs", nargs="+", default=list(SPECS), choices=list(SPECS), help="specs of the full table")
    parser.add_argument("--tune", action="store_true",
                        help="sweep block size x num_warps (x prefetch), the kernel alone")
    parser.add_argument("--tune-spec", nargs="+", default=TUNE_SPECS, choices=list(SPECS))
    parser.add_argument("--tune-tokens", type=int, nargs="+", default=[16384])
    parser.add_argument("--tune-vocab", type=int, nargs="+", default=[32000, 131072])
    parser.add_argument("--tune-block", type=int, nargs="+", default=None, help="override the block grid")
    parser.add_argument("--tune-warps", type=int, nargs="+", default=None, help="override the num_warps grid")
    parser.add_argument("--tune-prefetch", type=int, nargs="+", choices=(0, 1), default=None,
                        help="sweep loading each vocab block an iteration ahead (1) or not (0); "
                        "default: each spec's default")
    parser.add_argument("--tune-split", type=int, nargs="+", default=None,
                        help="sweep the fused launch's programs per row (powers of two); default: each spec's default")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a folder from tools/bench/make_baseline.sh (.baseline): time its fastlm_base ('before') "
                        "next to this tree ('after') on the same inputs, trainer call and kernel alone")
    parser.add_argument("--ab-shapes", nargs="+", default=["16384x32000", "16384x131072", "4096x32000"],
                        help="TxV shapes of the --baseline table")
    parser.add_argument("--rep-ms", type=int, default=None,
                        help=f"do_bench measuring time per case (ms); default 100, {TUNE_REP_MS} with --tune")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ.setdefault("FASTLM_COMPILE", "0")
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        parser.error("no CUDA device: use --cpu-smoke on CPU")
    else:
        device = torch.device("cuda")
    bench = Bench(device, args.rep_ms or (TUNE_REP_MS if args.tune else 100))
    copy_gb_s = bench.copy_gb_s()
    liger, liger_status = load_liger() if device.type == "cuda" else (None, "not on CPU")
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device {device_name}; liger: {liger_status}", flush=True)
    report: dict = {"device": str(device), "copy_gb_s": copy_gb_s, "liger": liger_status}
    if args.baseline is not None:
        sys.path.insert(0, str(args.baseline.resolve()))
        trees = [load_tree("before", "fastlm_base"), load_tree("after", "fastlm")]
        commit_file = args.baseline / "COMMIT"
        report["baseline"] = commit_file.read_text().strip() if commit_file.exists() else "?"
        print(f"before: fastlm_base {report['baseline']} from {args.baseline}; after: {ROOT}", flush=True)
        shapes = SMOKE_SHAPES if args.cpu_smoke else [tuple(int(n) for n in s.split("x")) for s in args.ab_shapes]
        report["ab_rows"] = ab_benchmark(shapes, bench, copy_gb_s, trees, args.specs)
        table = ab_table(report["ab_rows"])
    elif args.tune:
        tokens, vocabs = ([8], [96]) if args.cpu_smoke else (args.tune_tokens, args.tune_vocab)
        bench.tune_blocks = args.tune_block or bench.tune_blocks
        bench.tune_warps = args.tune_warps or bench.tune_warps
        prefetches = None if args.tune_prefetch is None else tuple(bool(f) for f in args.tune_prefetch)
        splits = None if args.tune_split is None else tuple(args.tune_split)
        report["tune"] = tune(tokens, vocabs, args.tune_spec, bench, copy_gb_s, prefetches, splits)
        report["suggested"] = suggest_defaults(report["tune"])
        table = tune_table(report["tune"], report["suggested"])
    else:
        report["rows"] = benchmark(SMOKE_SHAPES if args.cpu_smoke else GPU_SHAPES, bench, copy_gb_s, liger, args.specs)
        table = results_table(report["rows"], copy_gb_s)
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "bench_losses.json"
        path.write_text(json.dumps(report, indent=1, default=_round))
        print(f"wrote {path}")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
