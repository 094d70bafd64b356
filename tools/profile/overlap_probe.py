"""Can the loss kernel of one chunk hide under the dH/dW GEMMs of the previous one (two CUDA streams)?

    python tools/profile/overlap_probe.py [--specs ce ce+kd] [--rows 2048 4096] [--blas cublas cublaslt]
                                      [--carveouts 0 8 16]

Per chunk size R (V=131072, H=2048, bf16): the chunk's dH + dW GEMMs alone, the fused loss kernel alone
(in place, on another chunk's logits), both in one stream, and both at once on two streams (the loss
stream at high priority or not). Hidden share = (serial - overlapped) / loss alone. With a carve-out
(`torch._C._set_sm_carveout_experimental`, honoured by cuBLASLt only, so `--blas cublaslt`) the GEMMs
target that many SMs fewer, leaving them to the loss kernel.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

from bench_head import build_head, make_inputs  # noqa: E402

from fastlm.losses.triton.launcher import fused_kernel_only  # noqa: E402

VOCAB, HIDDEN = 131072, 2048


def per_call_ms(step: Callable[[], None], calls: int = 20) -> float:
    step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e3


def probe(spec_name: str, rows: int, device: torch.device, label: str) -> None:
    spec = build_head(spec_name, 0, device).spec
    inputs = make_inputs(rows, HIDDEN, VOCAB, spec, device)
    targets = inputs.targets
    if spec.teacher is not None:
        from dataclasses import replace

        targets = replace(targets, teacher_logits=targets.teacher_head.logits(torch.bfloat16), teacher_head=None)
    hidden, weight = inputs.hidden.detach(), inputs.weight.detach()
    grad = torch.randn(rows, VOCAB, device=device, dtype=torch.bfloat16)
    logits = torch.randn(rows, VOCAB, device=device, dtype=torch.bfloat16)
    source = logits.clone()
    grad_hidden, grad_weight = torch.empty_like(hidden), torch.zeros_like(weight)

    def gemms() -> None:
        torch.mm(grad, weight, out=grad_hidden)
        grad_weight.addmm_(grad.t(), hidden)

    def loss() -> None:
        fused_kernel_only(logits, targets, inputs.normalizers, spec, logits)

    def reset() -> None:
        logits.copy_(source)

    side, high = torch.cuda.Stream(device), torch.cuda.Stream(device, priority=-1)
    main = torch.cuda.current_stream(device)

    def overlapped(stream: torch.cuda.Stream) -> Callable[[], None]:
        def step() -> None:
            stream.wait_stream(main)
            gemms()
            with torch.cuda.stream(stream):
                loss()
            main.wait_stream(stream)
        return step

    reset_ms = per_call_ms(reset)
    times = {
        "gemms": per_call_ms(gemms),
        "loss": per_call_ms(lambda: (reset(), loss())) - reset_ms,
        "serial": per_call_ms(lambda: (reset(), gemms(), loss())) - reset_ms,
        "two streams": per_call_ms(lambda: (reset(), overlapped(side)())) - reset_ms,
        "two streams, loss high priority": per_call_ms(lambda: (reset(), overlapped(high)())) - reset_ms,
    }
    serial = times["serial"]
    print(f"\n{spec_name}, {rows} rows, {label}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in times.items()))
    for name in ("two streams", "two streams, loss high priority"):
        print(f"  {name}: hides {(serial - times[name]) / times['loss']:.0%} of the loss kernel")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", nargs="+", default=["ce", "ce+kd"])
    parser.add_argument("--rows", nargs="+", type=int, default=[2048, 4096])
    parser.add_argument("--blas", nargs="+", default=["cublas"], choices=["cublas", "cublaslt"])
    parser.add_argument("--carveouts", nargs="+", type=int, default=[0], help="SMs kept from cuBLASLt's GEMMs")
    args = parser.parse_args()
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    print(torch.cuda.get_device_name(), torch.__version__, sms, "SMs")
    for blas in args.blas:
        torch.backends.cuda.preferred_blas_library(blas)
        for carveout in args.carveouts if blas == "cublaslt" else [0]:
            torch._C._set_sm_carveout_experimental(carveout or None)
            for spec_name in args.specs:
                for rows in args.rows:
                    probe(spec_name, rows, device, f"{blas}, carve-out {carveout}")
    torch._C._set_sm_carveout_experimental(None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
