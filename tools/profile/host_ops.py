"""Count the host work of one `triton_loss` call: torch ops, Triton launches, and host time, no GPU needed.

    python tools/profile/host_ops.py                            # every bench spec (tools/bench_losses.py), this tree
    python tools/profile/host_ops.py --baseline .baseline --specs gspo+z  # and a baseline: tools/bench/make_baseline.sh

A call is host-bound when the host takes longer to enqueue it than the GPU takes to run it; then the
trainer waits for Python (`bench_losses --baseline`'s `host` column measures that time on the GPU).
Here every Triton launch is replaced by a no-op that only counts it, and a TorchDispatchMode counts
the torch ops of one call (views apart: they launch nothing on a GPU); the time is the median of
`--calls` calls on this CPU, so it measures Python and the dispatcher, not CUDA's launch cost (a GPU
host pays more per op: the counts are the portable number). The document weights take their CUDA
branch (one launch) as on a GPU. Inputs: tools/bench_losses.py's cases at `--tokens` x 128.
"""

from __future__ import annotations

import argparse
import collections
import contextvars
import importlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton's jit needs no driver; every launch is stubbed anyway

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

TOOLS = Path(__file__).resolve().parents[1]  # bench_losses.py's folder
sys.path.insert(0, str(TOOLS))
from bench_losses import SPECS, load_tree, make_case, tree_inputs  # noqa: E402

VIEWS = {"view", "_unsafe_view", "select", "slice", "unbind", "split", "expand", "as_strided", "t", "transpose",
         "permute", "unsqueeze", "squeeze", "alias", "detach"}


class OpCount(TorchDispatchMode):
    """Torch ops by name while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's hook signature
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class StubbedLaunch:
    """Stands in for a @triton.jit kernel: `kernel[grid](...)` only records the kernel's name."""

    def __init__(self, name: str, launches: list[str]) -> None:
        self.name, self.launches = name, launches

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launches.append(self.name)


LAUNCHES: dict[str, list[str]] = {}  # package -> its stubs' launch log


def stub_launches(package: str) -> list[str]:
    """Replace every Triton kernel the package's loss launchers call (once); returns the launch log."""
    if package in LAUNCHES:
        return LAUNCHES[package]
    launches = LAUNCHES[package] = []
    for module_name in ("losses.triton.launcher", "losses.triton.documents"):
        try:
            module = importlib.import_module(f"{package}.{module_name}")
        except ImportError:
            continue
        for name, value in vars(module).items():
            if type(value).__name__ in ("JITFunction", "InterpretedFunction"):
                setattr(module, name, StubbedLaunch(name, launches))
    policy = importlib.import_module(f"{package}.losses.children.policy")
    if hasattr(policy, "launched_document_means"):  # the CUDA branch: one (stubbed) launch
        documents = importlib.import_module(f"{package}.losses.triton.documents")
        policy.launched_document_means = documents.document_mean_weights
    elif hasattr(policy, "_document_kernel"):  # a baseline tree from before losses/document_weights.py
        policy._document_kernel = lambda labels: True
    return launches


def measure(package: str, tree_name: str, spec_name: str, tokens: int, calls: int) -> dict:
    """One spec in one tree: op counts and launches of one call, median host microseconds per call."""
    launches = stub_launches(package)
    tree = load_tree(tree_name, package)
    case = make_case(tokens, 128, 0, torch.device("cpu"), SPECS[spec_name].teacher is not None)
    targets, normalizers = tree_inputs(tree, case)
    spec = tree.specs[spec_name]

    def call() -> object:
        return tree.launcher.triton_loss(case.logits, targets, normalizers, spec)

    # The value checks are queued, never read: the stubbed launches leave their counts unset.
    pending = contextvars.copy_context()
    pending.run(tree.validation._PENDING.set, [])
    pending.run(call)  # warm: caches of the launcher
    launches.clear()
    with OpCount() as count:
        pending.run(call)
    one_call = list(launches)
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        pending.run(call)
        samples.append((time.perf_counter() - start) * 1e6)
    views = sum(n for op, n in count.ops.items() if op in VIEWS)
    return {"tree": tree_name, "spec": spec_name, "ops": sum(count.ops.values()) - views, "views": views,
            "launches": collections.Counter(one_call), "host_us": statistics.median(samples), "by_op": count.ops}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", nargs="+", default=list(SPECS), choices=list(SPECS))
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a tools/bench/make_baseline.sh folder (fastlm_base)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--by-op", action="store_true", help="list each torch op's count")
    args = parser.parse_args(argv)
    trees = [("after", "fastlm")]
    if args.baseline is not None:
        sys.path.insert(0, str(args.baseline.resolve()))
        trees.insert(0, ("before", "fastlm_base"))
    print("| spec | tree | torch ops (+ views) | Triton launches | host us/call (CPU, launches stubbed) |")
    print("|---|---|---|---|---|")
    for spec_name in args.specs:
        for tree_name, package in trees:
            found = measure(package, tree_name, spec_name, args.tokens, args.calls)
            launches = ", ".join(f"{name} x{n}" if n > 1 else name for name, n in found["launches"].items())
            print(f"| {spec_name} | {tree_name} | {found['ops']} (+{found['views']}) "
                  f"| {sum(found['launches'].values())}: {launches} | {found['host_us']:.0f} |")
            if args.by_op:
                print("  " + ", ".join(f"{op} {n}" for op, n in found["by_op"].most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
