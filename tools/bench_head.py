"""Benchmark the whole LM head (projection, loss, both gradients): fastlm's chunked head against its
full-logits head, the fused-linear peers and the three-GEMM floor, in one run.

    python tools/bench_head.py                    # ce, ce+z+grpo, ce+kd at T x H x V = {16384, 65536} x 2048 x 131072
    python tools/bench_head.py --specs ce ce+z --tokens 16384
    python tools/bench_head.py --cpu-smoke        # tiny shapes on CPU (the compiled path), seconds
    python tools/bench_head.py --specs ce+kd --splits 1 8   # the chunked head at 1 and 8 programs per row, side by side
    python tools/bench_head.py --specs ce+kd ce+jsd ce+kd_top64 --tokens 16384   # distillation's objectives

One call = forward + backward of the head: hidden (T, H) bf16 and weight (V, H) bf16, both requiring
grad, gradients by `torch.autograd.grad` (no accumulation into .grad). Columns:

- floor: the three GEMMs alone at full size (logits Z = H W^T, dH = G W, dW = G^T H, with G = Z's
  buffer); with distillation also the teacher's logits GEMM (teacher hidden size = H), with GSPO the
  second logits GEMM of its two passes: the work no head can skip;
- chunked: fastlm's LMHead at the default logits budget (`model.head.logits_memory_mib`, default 1408),
  dW summed in the weight's dtype (bf16 here); chunked+fp32dW: the same with an fp32 dW buffer;
- chunked split=N (`--splits`): the chunked column with the fused kernel's `split=N` programs per row
  (docs/tuning-log.md entry 19), to compare splits against the default in one run;
- baseline (`--baseline .baseline`, from tools/bench/make_baseline.sh): the chunked column with another
  commit's fastlm (`fastlm_base`), for a before/after of a head or kernel change in one run;
- full: fastlm's LMHead with logits_memory_mib 0 (full logits; skipped where it would not fit);
- liger: Liger-Kernel's fused linear cross entropy (CE; CE+z through lse_square_scale);
- cce: Cut Cross-Entropy's linear_cross_entropy (CE only, shipped defaults);
- eager: the float32 reference loss on the full logits, by autograd (where it fits).

Time = median of `triton.testing.do_bench` over at least 10 calls (CUDA; a perf_counter median on
CPU); the floor is timed first and again last in each row, and the ratios use the mean of both; extra memory = peak
allocated during one call minus what was allocated before it and minus the returned dH and dW (the
inputs and outputs). Accuracy: dH and dW of each fastlm column against the float32 eager gradients on
the same bf16 inputs (the first token count only; `err` columns). Peers missing from the environment
print "-". The last lines are a markdown table; the rows go to `$OUT/bench_head.json` when $OUT is set.
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
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from fastlm.losses.chunked_head import chunked_head_loss  # noqa: E402
from fastlm.losses.config import DEFAULT_LOGITS_MEMORY_MIB, LMHeadConfig  # noqa: E402
from fastlm.losses.reference import reference_loss  # noqa: E402
from fastlm.losses.spec import IGNORE_INDEX, LossNormalizers, LossSpec, LossTargets, TeacherHead  # noqa: E402

if TYPE_CHECKING:
    from fastlm.layers.lm_head import LMHead

# The head configs (`model.head.losses`) of the rows.
SPECS: dict[str, dict] = {
    "ce": {"cross_entropy": {}},
    "ce+z": {"cross_entropy": {}, "z_loss": {"weight": 1e-4}},
    "ce+z+grpo": {"cross_entropy": {}, "z_loss": {"weight": 1e-4}, "grpo": {"eps_low": 0.2, "eps_high": 0.2}},
    "ce+kd": {"cross_entropy": {}, "distillation": {"temperature": 2.0}},
    # the generalized JSD (Triton: stats, the mixture's vocab pass, grad) and the top-k support (compiled path)
    "ce+jsd": {"cross_entropy": {}, "distillation": {"temperature": 2.0, "kl": "jsd", "beta": 0.5}},
    "ce+kd_top64": {"cross_entropy": {}, "distillation": {"temperature": 2.0, "top_k": 64}},
    "gspo+z": {"gspo": {"eps_low": 3e-4, "eps_high": 4e-4}, "z_loss": {"weight": 1e-4}},
}
DEFAULT_SPECS = ["ce", "ce+z+grpo", "ce+kd"]
GPU_SHAPE = {"tokens": [16384, 65536], "hidden": 2048, "vocab": 131072}
SMOKE_SHAPE = {"tokens": [40], "hidden": 16, "vocab": 96}
COLUMNS = ("floor", "chunked", "chunked+fp32dW", "full", "liger", "cce", "eager")  # display order
FASTLM = ("chunked", "chunked+fp32dW", "full")  # the columns whose gradients are checked (and the split ones)
LIGER_Z_WEIGHT = {"ce": 0.0, "ce+z": 1e-4}  # the rows Liger's fused linear CE computes (z-loss: lse_square_scale)
BASELINE_PACKAGE = "fastlm_base"  # tools/bench/make_baseline.sh's copy of another commit, when --baseline is given
baseline_loaded = False
MEMORY_HEADROOM = 0.85  # a column runs when its estimated bytes fit in this share of the free memory


@dataclass
class Inputs:
    hidden: torch.Tensor  # (T, H) bf16, requires grad
    weight: torch.Tensor  # (V, H) bf16, requires grad
    targets: LossTargets
    normalizers: LossNormalizers


def build_head(spec_name: str, budget: float, device: torch.device) -> LMHead:
    """The row's head as dispatch picks it (the fused Triton kernel on CUDA, the compiled path on CPU),
    logits budget `budget` (0: full logits)."""
    from fastlm.layers.lm_head import LMHead  # lazy: it imports torch._dynamo (slow), only when a row runs

    return LMHead(LMHeadConfig(losses=SPECS[spec_name], logits_memory_mib=budget), device)


def make_inputs(tokens: int, hidden: int, vocab: int, spec: LossSpec, device: torch.device, seed: int = 0) -> Inputs:
    """Unit-scale hidden states, a weight of std 1/sqrt(H) (logits of std ~1), 1 in 7 labels masked,
    policy inputs and 512-token documents; with distillation a teacher head input of the same size."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=device, generator=generator) * scale).to(torch.bfloat16)

    labels = torch.randint(0, vocab, (tokens,), device=device, generator=generator)
    labels[seed % 7 :: 7] = IGNORE_INDEX
    document_ids = torch.arange(tokens, device=device) // 512
    teacher = None
    if spec.teacher is not None:
        teacher = TeacherHead(normal(tokens, hidden), normal(vocab, hidden, scale=hidden**-0.5))
    targets = LossTargets(
        labels, old_logp=-torch.rand(tokens, device=device, generator=generator) * 12.0,
        advantages=torch.randn(tokens, device=device, generator=generator), document_ids=document_ids,
        teacher_head=teacher,
    )
    mask = labels != IGNORE_INDEX
    normalizers = LossNormalizers(float(mask.sum()), float(document_ids[mask].unique().numel()))
    weight = normal(vocab, hidden, scale=hidden**-0.5)
    return Inputs(normal(tokens, hidden).requires_grad_(True), weight.requires_grad_(True), targets, normalizers)


def estimated_bytes(column: str, tokens: int, vocab: int, teacher: bool) -> int:
    """What a column holds beyond the inputs, roughly: (T, V) logits and gradients (bf16; eager: fp32 copies),
    and the teacher's (T, V) logits where the full-logits columns make them (H100 run: 2.95 x 2TV measured)."""
    full = tokens * vocab
    return {"floor": 2 * full, "full": (3 + teacher) * 2 * full, "eager": (6 + teacher) * 4 * full}.get(column, 0)


def fits(column: str, tokens: int, vocab: int, teacher: bool, device: torch.device) -> bool:
    """Whether the column's estimate fits the free memory (the allocator's cache given back first)."""
    if device.type != "cuda":
        return True
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    return estimated_bytes(column, tokens, vocab, teacher) < MEMORY_HEADROOM * free


def _with_teacher(targets: LossTargets, teacher_logits: torch.Tensor | None) -> LossTargets:
    return LossTargets(targets.labels, targets.old_logp, targets.advantages, targets.document_ids, teacher_logits)


def split_column(split: int) -> str:
    return f"chunked split={split}"


def columns(splits: tuple[int, ...]) -> tuple[str, ...]:
    """Display order: the split columns right after the default chunked one."""
    return (*COLUMNS[:2], *(split_column(s) for s in splits), *(("baseline",) if baseline_loaded else ()), *COLUMNS[2:])


def fastlm_columns(splits: tuple[int, ...]) -> tuple[str, ...]:
    return (*FASTLM, *(split_column(s) for s in splits), *(("baseline",) if baseline_loaded else ()))


def in_package(value: object, spec_module: ModuleType) -> object:
    """A fastlm.losses.spec dataclass (targets, normalizers, teacher head) as `spec_module`'s own class of that
    name, field by field; a field the other class lacks must be unset."""
    if not is_dataclass(value) or isinstance(value, type):
        return value
    other = getattr(spec_module, type(value).__name__)
    known = {f.name for f in fields(other)}
    unset = [f.name for f in fields(value) if f.name not in known and getattr(value, f.name) is not None]
    if unset:
        raise ValueError(f"{spec_module.__name__}.{other.__name__} has no {unset}")
    return other(**{f.name: in_package(getattr(value, f.name), spec_module) for f in fields(value) if f.name in known})


def baseline_call(spec_name: str, inputs: Inputs, device: torch.device) -> Callable[[], tuple]:
    """The chunked column on the baseline's fastlm: its own head, config and spec classes, the same tensors."""
    lm_head = importlib.import_module(f"{BASELINE_PACKAGE}.layers.lm_head")
    config = importlib.import_module(f"{BASELINE_PACKAGE}.losses.config")
    spec_module = importlib.import_module(f"{BASELINE_PACKAGE}.losses.spec")
    head = lm_head.LMHead(config.LMHeadConfig(losses=SPECS[spec_name],
                                              logits_memory_mib=config.DEFAULT_LOGITS_MEMORY_MIB), device)
    targets, normalizers = in_package(inputs.targets, spec_module), in_package(inputs.normalizers, spec_module)
    leaves = (inputs.hidden, inputs.weight)
    return lambda: torch.autograd.grad(head(inputs.hidden, inputs.weight, targets, normalizers).loss, leaves)


def column_calls(spec_name: str, inputs: Inputs, device: torch.device,
                 splits: tuple[int, ...] = ()) -> dict[str, Callable[[], tuple]]:
    """column -> a call doing forward + backward, returning (dH, dW) (the floor: its GEMM outputs)."""
    hidden, weight, targets, normalizers = inputs.hidden, inputs.weight, inputs.targets, inputs.normalizers
    leaves = (hidden, weight)
    tokens, vocab = hidden.shape[0], weight.shape[0]
    chunked, full = build_head(spec_name, DEFAULT_LOGITS_MEMORY_MIB, device), build_head(spec_name, 0, device)
    spec = chunked.spec
    teacher = spec.teacher is not None

    def fastlm(head: LMHead) -> Callable[[], tuple]:
        return lambda: torch.autograd.grad(head(hidden, weight, targets, normalizers).loss, leaves)

    def chunked_with(fp32_weight_grad: bool = False, **options: int) -> Callable[[], tuple]:
        def call() -> tuple:
            result = chunked_head_loss(hidden, weight, targets, normalizers, spec, chunked.resolve(device),
                                       DEFAULT_LOGITS_MEMORY_MIB, fp32_weight_grad=fp32_weight_grad, options=options)
            return torch.autograd.grad(result.loss, leaves)

        return call

    def eager() -> tuple:
        """bf16 logits (and teacher logits), the float32 reference loss on them by autograd."""
        teacher_logits = None if spec.teacher is None else targets.teacher_head.logits()
        logits = (hidden @ weight.t()).float()
        loss = reference_loss(logits, _with_teacher(targets, teacher_logits), normalizers, spec).loss
        return torch.autograd.grad(loss, leaves)

    calls: dict[str, Callable[[], tuple]] = {"chunked": fastlm(chunked), "chunked+fp32dW": chunked_with(True)}
    calls.update({split_column(split): chunked_with(split=split) for split in splits})
    if baseline_loaded:
        calls["baseline"] = baseline_call(spec_name, inputs, device)
    if fits("floor", tokens, vocab, teacher, device):
        calls["floor"] = floor_call(inputs, spec)
    if fits("full", tokens, vocab, teacher, device):
        calls["full"] = fastlm(full)
    liger = load_liger() if device.type == "cuda" and spec_name in LIGER_Z_WEIGHT else None
    if liger is not None:
        module = liger(lse_square_scale=LIGER_Z_WEIGHT[spec_name])
        calls["liger"] = lambda: torch.autograd.grad(module(weight, hidden, targets.labels), leaves)
    cce = load_cce() if device.type == "cuda" and spec_name == "ce" else None
    if cce is not None:
        calls["cce"] = lambda: torch.autograd.grad(cce(hidden, weight, targets.labels), leaves)
    if fits("eager", tokens, vocab, teacher, device):
        calls["eager"] = eager
    return calls


def reference_grads(inputs: Inputs, spec: LossSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 everywhere (GEMMs too) from the same bf16 inputs, by autograd: the accuracy yardstick."""
    hidden = inputs.hidden.detach().float().requires_grad_(True)
    weight = inputs.weight.detach().float().requires_grad_(True)
    teacher = inputs.targets.teacher_head
    teacher_logits = None if spec.teacher is None else teacher.hidden.float() @ teacher.weight.float().t()
    targets = _with_teacher(inputs.targets, teacher_logits)
    loss = reference_loss(hidden @ weight.t(), targets, inputs.normalizers, spec).loss
    return torch.autograd.grad(loss, (hidden, weight))


def floor_call(inputs: Inputs, spec: LossSpec) -> Callable[[], tuple]:
    """The head's GEMMs alone into preallocated outputs (with GSPO the logits GEMM twice; with a teacher its
    GEMM too)."""
    hidden, weight = inputs.hidden.detach(), inputs.weight.detach()
    logits = torch.empty(hidden.shape[0], weight.shape[0], dtype=hidden.dtype, device=hidden.device)
    grad_hidden, grad_weight = torch.empty_like(hidden), torch.empty_like(weight)
    teacher = inputs.targets.teacher_head if spec.teacher is not None else None
    passes = 2 if spec.per_document else 1

    def call() -> tuple:
        for _ in range(passes):
            torch.mm(hidden, weight.t(), out=logits)
        if teacher is not None:
            torch.mm(teacher.hidden, teacher.weight.t(), out=logits)
        torch.mm(logits, weight, out=grad_hidden)
        torch.mm(logits.t(), hidden, out=grad_weight)
        return grad_hidden, grad_weight

    return call


def load_liger() -> type | None:
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except Exception as error:  # noqa: BLE001 - any import failure means "not available"; the reason is printed
        print(f"liger: not available ({type(error).__name__}: {error})", flush=True)
        return None
    return LigerFusedLinearCrossEntropyLoss


def load_cce() -> Callable | None:
    try:
        from cut_cross_entropy import linear_cross_entropy
    except Exception as error:  # noqa: BLE001
        print(f"cce: not available ({type(error).__name__}: {error})", flush=True)
        return None
    return linear_cross_entropy


MIN_REPEATS = 10  # do_bench repeats rep_ms / (one call); a 160 ms head call would get one


def time_ms(call: Callable[[], object], device: torch.device, rep_ms: int) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        rep = max(rep_ms, round(MIN_REPEATS * (time.perf_counter() - start) * 1e3))
        return float(do_bench(call, warmup=max(10, rep_ms // 4), rep=rep, return_mode="median"))
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        call()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def extra_mib(call: Callable[[], tuple], device: torch.device) -> float | None:
    """Peak allocated during one call, above what was allocated before it, minus the returned gradients."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = call()
    torch.cuda.synchronize()
    outputs = sum(g.numel() * g.element_size() for g in grads)
    peak = torch.cuda.max_memory_allocated() - before - outputs
    del grads
    return peak / 2**20


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.float(), expected.float()
    return float((actual - expected).norm() / expected.norm())


def bench_row(spec_name: str, tokens: int, hidden: int, vocab: int, device: torch.device, rep_ms: int,
              check: bool, splits: tuple[int, ...] = ()) -> dict:
    """Every column of one (spec, shape); `check`: the fastlm columns' dH, dW against `reference_grads`."""
    spec = build_head(spec_name, 0, device).spec
    inputs = make_inputs(tokens, hidden, vocab, spec, device)
    row: dict = {"spec": spec_name, "tokens": tokens, "hidden": hidden, "vocab": vocab, "ms": {}, "extra_mib": {},
                 "err": {}, "failed": {}}
    reference = None
    if check:
        try:
            reference = reference_grads(inputs, spec)
        except Exception as error:  # noqa: BLE001 - the timings still run
            row["failed"]["reference"] = f"{type(error).__name__}: {error}"
            traceback.print_exc()
    calls = column_calls(spec_name, inputs, device, splits)
    for column in (c for c in columns(splits) if c in calls):
        try:
            grads = calls[column]()  # warm-up (compiles), and the accuracy sample
            if reference is not None and column in fastlm_columns(splits):
                row["err"][column] = {"dH": rel_err(grads[0], reference[0]), "dW": rel_err(grads[1], reference[1])}
            del grads
            row["ms"][column] = time_ms(calls[column], device, rep_ms)
            row["extra_mib"][column] = extra_mib(calls[column], device)
        except Exception as error:  # noqa: BLE001 - keep the other columns' measurements
            row["failed"][column] = f"{type(error).__name__}: {error}"
            traceback.print_exc()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del reference
    if "floor" in row["ms"]:  # the floor again after the other columns: the ratio uses the mean of both
        row["floor_ms"] = (row["ms"]["floor"], time_ms(calls["floor"], device, rep_ms))
        row["ms"]["floor"] = statistics.mean(row["floor_ms"])
    floor = row["ms"].get("floor")
    row["x_floor"] = {column: ms / floor for column, ms in row["ms"].items()} if floor else {}
    shown = ("spec", "tokens", "ms", "floor_ms", "extra_mib", "err", "failed")
    print(json.dumps({k: row[k] for k in shown if k in row}, default=_round), flush=True)
    return row


def _round(value: object) -> object:
    return round(value, 4) if isinstance(value, float) else str(value)


def table(rows: list[dict], device_name: str, splits: tuple[int, ...] = ()) -> str:
    shown, checked = columns(splits), fastlm_columns(splits)
    lines = [
        f"device {device_name}; torch {torch.__version__}; ms = median forward+backward of the head, (x) = / floor, "
        "+MiB = peak extra memory beyond inputs and the returned dH, dW; err = dH/dW vs float32 eager",
        "| spec | T x H x V | " + " | ".join(shown) + " | " + " | ".join(f"err {c}" for c in checked) + " |",
        "|" + "---|" * (len(shown) + len(checked) + 2),
    ]
    for row in rows:
        cells = []
        for column in shown:
            ms, extra, ratio = row["ms"].get(column), row["extra_mib"].get(column), row["x_floor"].get(column)
            if ms is None:
                cells.append("fail" if column in row["failed"] else "-")
                continue
            cell = f"{ms:.2f}" + (f" ({ratio:.2f}x)" if ratio else "")
            cells.append(cell + (f", +{extra:.0f}" if extra is not None else ""))
        errs = [f"{e['dH']:.1e}/{e['dW']:.1e}" if (e := row["err"].get(column)) else "-" for column in checked]
        lines.append(f"| {row['spec']} | {row['tokens']} x {row['hidden']} x {row['vocab']} | " + " | ".join(cells)
                     + " | " + " | ".join(errs) + " |")
    ratios = [f"{row['spec']} {row['tokens']}: {row['ms']['chunked'] / row['ms']['baseline']:.3f}"
              for row in rows if "chunked" in row["ms"] and "baseline" in row["ms"]]
    if ratios:
        lines.append("chunked / baseline (this tree's time over the baseline's): " + ", ".join(ratios))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU (the compiled path)")
    parser.add_argument("--specs", nargs="+", default=DEFAULT_SPECS, choices=list(SPECS))
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench measuring time per column (ms)")
    parser.add_argument("--splits", type=int, nargs="+", default=[],
                        help="extra chunked columns at these programs per row of the fused kernel (CUDA)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a folder from tools/bench/make_baseline.sh: a `baseline` column (its fastlm's chunked head)")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        os.environ.setdefault("FASTLM_COMPILE", "0")
        device, shape = torch.device("cpu"), SMOKE_SHAPE
    elif not torch.cuda.is_available():
        parser.error("no CUDA device: use --cpu-smoke on CPU")
    else:
        device, shape = torch.device("cuda"), GPU_SHAPE
    if args.splits and device.type != "cuda":
        parser.error("--splits tunes the Triton kernel: it needs a CUDA device")
    splits = tuple(args.splits)
    if args.baseline is not None:
        global baseline_loaded
        sys.path.insert(0, str(args.baseline.resolve()))
        baseline_loaded = True
        commit = args.baseline / "COMMIT"
        print(f"baseline: {BASELINE_PACKAGE} {commit.read_text().strip() if commit.exists() else '?'}", flush=True)
    tokens = args.tokens or shape["tokens"]
    hidden, vocab = args.hidden or shape["hidden"], args.vocab or shape["vocab"]
    rows = []
    for index, count in enumerate(tokens):
        for spec_name in args.specs:
            try:
                rows.append(bench_row(spec_name, count, hidden, vocab, device, args.rep_ms, check=index == 0,
                                      splits=splits))
            except Exception:  # noqa: BLE001 - a failed row must not lose the others
                traceback.print_exc()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "bench_head.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"device": device_name, "splits": splits, "rows": rows}, indent=1, default=_round))
        print(f"wrote {path}")
    print(table(rows, device_name, splits))
    return 0


if __name__ == "__main__":
    sys.exit(main())
