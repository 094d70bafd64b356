"""Where the chunked head's time over the three-GEMM floor goes, as a function of the chunk size (H200).

    python tools/gpu/head_chunks.py            # ~2 minutes: the dH GEMM's efficiency by rows, then the head by budget

1. The per-chunk dH GEMM (G_c (M, V) @ W (V, H)) alone for M = 1024..6144 in steps of 128, H = 2048 and
   4096, V = 131072, bf16: ms and TFLOP/s. Its output has only M x H elements, so its tiles fill few waves
   of SMs; a chunk size whose tile count leaves a last wave nearly empty pays for a whole wave.
2. The chunked head (ce, ce+kd) at several `logits_memory_mib` budgets, each row with the floor timed in
   the same process: the chunk size each budget gives, ms and x floor.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

from bench_head import build_head, floor_call, make_inputs, time_ms  # noqa: E402

from fastlm.losses.chunked_head import chunk_tokens  # noqa: E402

VOCAB = 131072


def gemm_curve(hidden: int, device: torch.device) -> None:
    weight = torch.randn(VOCAB, hidden, device=device, dtype=torch.bfloat16)
    grads = torch.randn(6144, VOCAB, device=device, dtype=torch.bfloat16)
    out = torch.empty(6144, hidden, device=device, dtype=torch.bfloat16)
    print(f"dH GEMM (M x {VOCAB}) @ ({VOCAB} x {hidden}), bf16, SMs {torch.cuda.get_device_properties(0).multi_processor_count}")
    print("| M | ms | TFLOP/s | ms per 1k rows |")
    print("|---|---|---|---|")
    for rows in range(1024, 6144 + 1, 128):
        ms = time_ms(lambda rows=rows: torch.mm(grads[:rows], weight, out=out[:rows]), device, 60)
        flops = 2 * rows * VOCAB * hidden
        print(f"| {rows} | {ms:.3f} | {flops / ms / 1e9:.0f} | {ms / rows * 1e3:.3f} |", flush=True)


def head_by_budget(spec_name: str, tokens: int, budgets: list[float], device: torch.device) -> None:
    spec = build_head(spec_name, 0, device).spec
    inputs = make_inputs(tokens, 2048, VOCAB, spec, device)
    leaves = (inputs.hidden, inputs.weight)
    floor = time_ms(floor_call(inputs, spec), device, 100)
    for budget in budgets:
        head = build_head(spec_name, budget, device)
        chunk = chunk_tokens(tokens, VOCAB, 2, budget, spec.teacher is not None)

        def call(head=head) -> tuple:
            return torch.autograd.grad(head(inputs.hidden, inputs.weight, inputs.targets, inputs.normalizers).loss, leaves)

        call()
        ms = time_ms(call, device, 100)
        print(f"| {spec_name} | {tokens} | {budget:g} | {chunk} x {math.ceil(tokens / chunk)} | {ms:.2f} | "
              f"{floor:.2f} | {ms / floor:.3f} |", flush=True)
        torch.cuda.empty_cache()


def main() -> int:
    device = torch.device("cuda")
    for hidden in (2048, 4096):
        gemm_curve(hidden, device)
        torch.cuda.empty_cache()
    print("| spec | T | budget MiB | chunk x count | ms | floor ms | x floor |")
    print("|---|---|---|---|---|---|---|")
    for tokens in (16384, 65536):
        for spec_name in ("ce", "ce+kd"):
            head_by_budget(spec_name, tokens, [512, 768, 1024, 1408], device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
