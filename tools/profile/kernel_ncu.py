"""Nsight Compute's view of the fused loss kernel alone (one launch per spec and shape), to tell what
limits it: DRAM bytes against R1, issue slots, warps per scheduler, the SM clock.

    ncu --clock-control none -k regex:lm_loss_kernel --launch-skip 1 --launch-count 1 \
        python tools/profile/kernel_ncu.py --spec ce+kd --tokens 1536 --vocab 131072

Each shape launches the kernel twice (a warm-up that compiles, then the profiled one)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import torch  # noqa: E402
from bench_losses import SPECS, make_case, roofline_bytes  # noqa: E402

from fastlm.losses.triton.launcher import fused_kernel_only  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", default="ce+kd", choices=list(SPECS))
    parser.add_argument("--tokens", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=131072)
    args = parser.parse_args()
    spec = SPECS[args.spec]
    case = make_case(args.tokens, args.vocab, 0, torch.device("cuda"), spec.teacher is not None)
    for _ in range(2):
        fused_kernel_only(case.logits, case.targets, case.normalizers, spec, case.logits)
    torch.cuda.synchronize()
    print(f"{args.spec} {args.tokens} x {args.vocab}: R1 bytes {roofline_bytes(case, spec) / 1e9:.3f} GB")


if __name__ == "__main__":
    main()
