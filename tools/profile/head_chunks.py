"""Where the chunked head's time over the GEMM floor goes: variants of the head timed side by side (CUDA).

    python tools/profile/head_chunks.py                      # ~3 minutes: ce, ce+z+grpo, ce+kd at 16384 and 65536
    python tools/profile/head_chunks.py --tokens 16384 --specs ce+kd --rounds 3

1. Variants of the chunked head (V=131072, H=2048, bf16, forward + backward by `torch.autograd.grad`),
   timed interleaved: every round times each variant once (a few calls between two CUDA events), so
   a GPU that slows down as the run goes on slows every variant alike; the median over rounds is kept.
   The variants patch one thing each (the value-check read, the grad_output scaling, the budget):
   - default: the shipped rule (1408 MiB: 4096-token chunks; with a teacher its logits 1536 at a time);
   - mul_ scale: backward multiplies dH and dW by grad_output with `mul_` (one pass over dW even for a 1);
   - end read: the value checks read at the call's end (a full drain of the GPU; before session 10 the
     copy to the host did not start as soon as the counts were made);
   - full: the full-logits head (logits_memory_mib 0);
   - deferred: the default inside `deferred_value_checks()`, as the trainer calls it (the value checks
     read once per step, not at the end of every call);
   - unsplit: the fused kernel with one program per row (`SPLIT_SEGMENT_COLUMNS` past any vocabulary,
     so with distillation 4096/4 as before tuning-log entry 19; the default without distillation);
   - equal-buffers: with a teacher, student and teacher logits in two buffers of one chunk each (2048
     tokens at 1408 MiB: the rule before session 14);
   - budget-1536: 1536 MiB, the issue's 1.5 GiB (with a teacher 4096-token chunks and its logits 2048 at a time);
   - chunk-8192: 2816 MiB, twice the default's chunk (with a teacher, 3072 of its logits at a time);
   - kernel-file: the default with the fused loss kernel taken from `--kernel-file` (another version of
     kernel.py with the same arguments, e.g. `git show HEAD~1:fastlm/losses/triton/kernel.py > /tmp/k.py`):
     two kernels in one run.
   `--variants` picks some.
2. With --syncs: every synchronizing CUDA call of one default call, with the Python stack that made it.
3. With --trace DIR: a chrome trace of three default calls (CPU ops and kernels) per `--profile-specs`
   at `--profile-tokens`, and the GPU's idle time between kernels, the largest gaps named by the
   kernels around them.
4. A kernel-time profile of the default head, the other picked variants (not `full`) and the floor at
   `--profile-tokens` (ce, ce+kd): CUDA time per call by kernel, so the gap over the floor is named
   (GEMMs, the loss kernel, the rest).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import shutil
import statistics
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

from bench_head import Inputs, build_head, extra_mib, floor_call, make_inputs  # noqa: E402

import fastlm.losses.chunked_head as chunked_head  # noqa: E402
import fastlm.losses.triton.launcher as launcher  # noqa: E402
import fastlm.losses.triton.scale as scale  # noqa: E402
import fastlm.losses.validation as validation  # noqa: E402
from fastlm.losses.validation import deferred_value_checks  # noqa: E402

VOCAB, HIDDEN = 131072, 2048


def _mul(tensor: torch.Tensor, factor: torch.Tensor) -> None:
    tensor.mul_(factor)


class _EndRead:
    """The value-check read before session 10: the counts read at the call's end, after its chunks (a full drain)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def read(self) -> list[float]:
        return self.tensor.tolist()


def _patch(module: object, name: str, value: object) -> Callable[[], object]:
    return lambda: mock.patch.object(module, name, value)


# name -> (logits budget MiB, context managers to run the call in); STUDENT_ONLY variants not with a teacher
VARIANTS: dict[str, tuple[float, tuple]] = {
    "default": (1408, ()),
    "deferred": (1408, (deferred_value_checks,)),
    "mul_ scale": (1408, (_patch(scale, "scale_unless_one", _mul),)),
    "end read": (1408, (_patch(validation, "_HostCopy", _EndRead),)),
    "full": (0, ()),
    "full deferred": (0, (deferred_value_checks,)),
    "unsplit": (1408, (_patch(launcher, "SPLIT_SEGMENT_COLUMNS", 1 << 40),)),
    "equal-buffers": (1408, (_patch(chunked_head, "TEACHER_PIECES", 1),)),
    "budget-1536": (1536, ()),
    "chunk-8192": (2816, ()),  # 2 GiB without a teacher, 2.75 with one: over the 1.5
}


def kernel_from(path: Path) -> object:
    """`lm_loss_kernel` of another kernel.py, loaded as a module of its own."""
    module_spec = importlib.util.spec_from_file_location("kernel_file", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.lm_loss_kernel


@contextmanager
def entered(contexts: tuple) -> Iterator[None]:
    with ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context())
        yield


def head_call(head: torch.nn.Module, inputs: Inputs, contexts: tuple = ()) -> Callable[[], tuple]:
    """The head's forward + backward on `inputs` (dH, dW by `torch.autograd.grad`), run under `contexts`."""

    def call() -> tuple:
        with entered(contexts):
            loss = head(inputs.hidden, inputs.weight, inputs.targets, inputs.normalizers).loss
            return torch.autograd.grad(loss, (inputs.hidden, inputs.weight))

    return call


def timed_rounds(calls: dict[str, Callable[[], object]], rounds: int, per_round: int) -> dict[str, list[float]]:
    """ms per call of each variant, one sample per round, the variants interleaved within a round."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(per_round):
                call()
            end.record()
            torch.cuda.synchronize()
            samples[name].append(start.elapsed_time(end) / per_round)
    return samples


def variant_calls(spec_name: str, tokens: int, device: torch.device,
                  variants: list[str]) -> tuple[dict[str, Callable[[], object]], dict[str, float]]:
    """Each variant's forward + backward (run under its patches), after one warm-up call; its extra MiB."""
    head0 = build_head(spec_name, 1408, device)
    teacher = head0.spec.teacher is not None
    inputs = make_inputs(tokens, HIDDEN, VOCAB, head0.spec, device)
    calls: dict[str, Callable[[], object]] = {"floor": floor_call(inputs, head0.spec)}
    memory: dict[str, float] = {}
    for name in variants:
        budget, contexts = VARIANTS[name]
        if name.startswith("full") and tokens * VOCAB * 2 * (4 if teacher else 3) > 0.8 * torch.cuda.mem_get_info()[0]:
            continue
        call = head_call(build_head(spec_name, budget, device), inputs, contexts)
        memory[name] = extra_mib(call, device) or 0.0
        calls[name] = call
    return calls, memory


def compare(spec_name: str, tokens: int, rounds: int, device: torch.device, variants: list[str]) -> None:
    calls, memory = variant_calls(spec_name, tokens, device, variants)
    samples = timed_rounds(calls, rounds, max(2, 131072 // tokens))  # ~0.4 s a variant a round
    floor = statistics.median(samples["floor"])
    for name, values in samples.items():
        ms = statistics.median(values)
        spread = (max(values) - min(values)) / ms
        print(f"| {spec_name} | {tokens} | {name} | {ms:.2f} | {ms / floor:.3f} | {spread:.1%} | "
              f"{memory.get(name, 0):.0f} |", flush=True)
    del calls
    torch.cuda.empty_cache()


def profile(spec_name: str, tokens: int, device: torch.device, variants: list[str], calls: int = 3) -> None:
    """CUDA time per call by kernel (the top ones): the default head, the other chunked variants, the floor."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    spec = build_head(spec_name, 1408, device).spec
    inputs = make_inputs(tokens, HIDDEN, VOCAB, spec, device)
    runs = {"floor": floor_call(inputs, spec)}
    for name in ("default", *(v for v in variants if VARIANTS[v][0] and v != "default")):
        budget, contexts = VARIANTS[name]
        runs[name] = head_call(build_head(spec_name, budget, device), inputs, contexts)
    for name, call in runs.items():
        call()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                call()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        events.sort(key=lambda e: -e.device_time_total)
        total = sum(e.self_device_time_total for e in events) / calls / 1e3
        parts = {"GEMMs": 0.0, "loss kernel": 0.0, "other": 0.0}
        for event in events:
            key = event.key.lower()
            part = "loss kernel" if "lm_loss" in key else "GEMMs" if any(
                word in key for word in ("gemm", "nvjet", "cutlass", "xmma")) else "other"
            parts[part] += event.self_device_time_total / calls / 1e3
        print(f"\n{spec_name} {tokens} {name}: {total:.2f} ms of kernels a call ("
              + ", ".join(f"{part} {ms:.2f}" for part, ms in parts.items()) + ")")
        print("| kernel | launches a call | ms a call |")
        print("|---|---|---|")
        for event in events[:14]:
            print(f"| {event.key[:90]} | {event.count / calls:g} | {event.self_device_time_total / calls / 1e3:.3f} |")
    del runs, inputs
    torch.cuda.empty_cache()


def default_call(spec_name: str, tokens: int, device: torch.device) -> tuple[Callable[[], tuple], Callable[[], tuple]]:
    """The default head's forward + backward, and the floor's GEMMs, on the same inputs."""
    head = build_head(spec_name, 1408, device)
    inputs = make_inputs(tokens, HIDDEN, VOCAB, head.spec, device)
    return head_call(head, inputs), floor_call(inputs, head.spec)


def find_syncs(spec_name: str, tokens: int, device: torch.device) -> None:
    """Each synchronizing CUDA call of one default call (torch's sync debug mode), with its Python stack."""
    call, _ = default_call(spec_name, tokens, device)
    call()
    torch.cuda.synchronize()
    syncs: list[tuple[str, str]] = []

    def record(message: Warning | str, *args: object, **kwargs: object) -> None:
        frames = [line for line in traceback.format_stack()[:-1] if "fastlm" in line or "head_chunks" in line]
        syncs.append((str(message)[:90], "".join(frames[-4:])))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print(f"\n{spec_name} {tokens} default: {len(syncs)} warnings (synchronizing CUDA calls) in one call")
    for message, stack in syncs:
        print(f"- {message}\n{stack}")
    torch.cuda.empty_cache()


def trace(spec_name: str, tokens: int, device: torch.device, directory: Path, calls: int = 3) -> None:
    """A chrome trace of `calls` default calls, and the GPU's idle gaps between kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    call, _ = default_call(spec_name, tokens, device)
    call()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    directory.mkdir(parents=True, exist_ok=True)
    # no "+" in the name: $OUT brings back letters, digits and ._- only
    path = directory / f"trace_{spec_name.replace('+', '-')}_{tokens}.json"
    prof.export_chrome_trace(str(path))
    with path.open("rb") as source, gzip.open(f"{path}.gz", "wb") as target:
        shutil.copyfileobj(source, target)
    path.unlink()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    gaps = [(b.time_range.start - a.time_range.end, a.name, b.name) for a, b in zip(kernels, kernels[1:])]
    span = (kernels[-1].time_range.end - kernels[0].time_range.start) / 1e3
    idle = sum(gap for gap, _, _ in gaps if gap > 0) / 1e3
    print(f"\n{spec_name} {tokens} default, {calls} calls: GPU span {span / calls:.2f} ms a call, idle between kernels "
          f"{idle / calls:.2f} ms a call; largest gaps (us, after -> before):")
    for gap, before, after in sorted(gaps, reverse=True)[:12]:
        print(f"  {gap:8.0f}  {before[:50]} -> {after[:50]}")
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", nargs="+", default=["ce", "ce+z+grpo", "ce+kd"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=[*VARIANTS, "kernel-file"])
    parser.add_argument("--kernel-file", type=Path, help="the kernel.py of the `kernel-file` variant")
    parser.add_argument("--profile-tokens", type=int, default=16384)
    parser.add_argument("--profile-specs", nargs="+", default=["ce", "ce+kd"])
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--no-compare", action="store_true")
    parser.add_argument("--syncs", action="store_true", help="list the synchronizing CUDA calls of a default call")
    parser.add_argument("--trace", type=Path, help="write chrome traces here and print the GPU's idle gaps")
    args = parser.parse_args(argv)
    if "kernel-file" in args.variants:
        if args.kernel_file is None:
            parser.error("the kernel-file variant needs --kernel-file")
        kernel = kernel_from(args.kernel_file)
        VARIANTS["kernel-file"] = (VARIANTS["default"][0], (_patch(launcher, "lm_loss_kernel", kernel),))
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; V={VOCAB}, H={HIDDEN}, bf16, median of "
          f"{args.rounds} interleaved rounds; spread = (max - min) / median")
    for spec_name in ("ce", "ce+kd") if args.syncs else ():
        find_syncs(spec_name, 16384, device)
    for spec_name in args.profile_specs if args.trace else ():
        trace(spec_name, args.profile_tokens, device, args.trace)
    if not args.no_compare:
        print("| spec | T | variant | ms | x floor | spread | +MiB |")
        print("|---|---|---|---|---|---|---|")
    for tokens in () if args.no_compare else args.tokens:
        for spec_name in args.specs:
            compare(spec_name, tokens, args.rounds, device, args.variants)
    if not args.no_profile:
        for spec_name in args.profile_specs:
            profile(spec_name, args.profile_tokens, device, args.variants)
    return 0


if __name__ == "__main__":
    sys.exit(main())
