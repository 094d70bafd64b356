"""Compile the fused loss kernel for a GPU target on any machine (no GPU needed) and report its
resources: registers, stack frame, local memory, and the SASS size of each variant.

    python tools/profile/kernel_report.py                                   # default specs and shapes, sm_90
    python tools/profile/kernel_report.py --spec ce+kd --vocab 32000 --block 4096 8192 --warps 4 8
    python tools/profile/kernel_report.py --prefetch 1 --sass-dir /tmp/sass   # prefetching variant, and its SASS

The arguments are the launcher's own (`fused_kernel_only` runs with a recorder in place of the
kernel), so what compiles here is what the H200 runs. Needs Triton's bundled `cuobjdump`.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # this tool compiles for the GPU; it never interprets
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fastlm.losses.triton import launcher  # noqa: E402
from fastlm.losses.triton.kernel import lm_loss_kernel  # noqa: E402

sys.path.insert(0, str(ROOT / "tools"))
from bench_losses import SPECS, make_case  # noqa: E402

OPTIONS = ("num_warps", "enable_fp_fusion")  # the launch options the launcher passes


class _Recorder:
    """Stands in for the kernel: `kernel[grid](*args, **kwargs)` records the call instead of launching."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid: tuple) -> object:
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def recorded_launch(spec_name: str, vocab: int, block: int | None, warps: int | None, prefetch: bool | None) -> tuple:
    """(args, kwargs) of the fused launch for a tiny case (8 tokens; only dtypes and constexprs matter)."""
    spec = SPECS[spec_name]
    case = make_case(8, vocab, 0, torch.device("cpu"), spec.teacher is not None)
    recorder = _Recorder()
    original, launcher.lm_loss_kernel = launcher.lm_loss_kernel, recorder
    try:
        launcher.fused_kernel_only(case.logits, case.targets, case.normalizers, spec, torch.empty_like(case.logits),
                                   max_block=block, num_warps=warps, prefetch=prefetch)
    finally:
        launcher.lm_loss_kernel = original
    (call,) = recorder.calls
    return call


def compile_variant(args: tuple, kwargs: dict, capability: int) -> triton.compiler.CompiledKernel:
    """Compile as the JIT launch would: each argument specialized like `JITFunction.run` does it (16-byte
    aligned pointers and ints divisible by 16 marked so, ints equal to 1 made constant), so loads vectorize
    here exactly where they do on the GPU."""
    names = list(lm_loss_kernel.arg_names)
    values = {**dict(zip(names, args)), **{name: kwargs[name] for name in names if name in kwargs}}
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(lm_loss_kernel.params):
        value = values[param.name]
        if param.is_constexpr:
            kind, key = "constexpr", None
        else:
            kind, key = native_specialize_impl(BaseBackend, value, False, True, True)
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[(index,)] = value
        elif isinstance(key, str):
            attrs[(index,)] = BaseBackend.parse_attr(key)
    source = ASTSource(lm_loss_kernel, signature, constexprs=constexprs, attrs=attrs)
    options = {key: kwargs[key] for key in OPTIONS if key in kwargs}
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)


def resources(cubin: bytes) -> dict:
    """REG / STACK / SHARED / LOCAL from cuobjdump's resource usage, and the SASS with its instruction count."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", handle.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", handle.name], capture_output=True, text=True, check=True).stdout
    found = {key: int(value) for key, value in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    found["sass_instructions"] = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, flags=re.M))
    found["sass"] = sass
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", nargs="+", default=["ce", "ce+z+grpo", "ce+kd"], choices=list(SPECS))
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 131072])
    parser.add_argument("--block", type=int, nargs="+", default=[None])
    parser.add_argument("--warps", type=int, nargs="+", default=[None])
    parser.add_argument("--prefetch", type=int, choices=(0, 1), default=None)
    parser.add_argument("--capability", type=int, default=90)
    parser.add_argument("--sass-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    print(f"triton {triton.__version__}, sm_{args.capability}")
    print("| spec | V | block | warps | prefetch | registers | stack | local | SASS instructions |")
    print("|---|---|---|---|---|---|---|---|---|")
    for spec_name in args.spec:
        for vocab in args.vocab:
            for block in args.block:
                for warps in args.warps:
                    prefetch = None if args.prefetch is None else bool(args.prefetch)
                    call_args, kwargs = recorded_launch(spec_name, vocab, block, warps, prefetch)
                    found = resources(compile_variant(call_args, kwargs, args.capability).asm["cubin"])
                    print(f"| {spec_name} | {vocab} | {kwargs['LAUNCH'].block} | {kwargs['num_warps']} "
                          f"| {kwargs['LAUNCH'].prefetch} | {found.get('REG')} | {found.get('STACK')} "
                          f"| {found.get('LOCAL')} | {found['sass_instructions']} |", flush=True)
                    if args.sass_dir:
                        args.sass_dir.mkdir(parents=True, exist_ok=True)
                        schedule = f"{kwargs['LAUNCH'].block}_{kwargs['num_warps']}_{int(kwargs['LAUNCH'].prefetch)}"
                        name = f"{spec_name}_{vocab}_{schedule}.sass"
                        (args.sass_dir / name).write_text(found["sass"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
