"""On a CUDA machine: run the Triton loss tests compiled (not interpreted), then time the loss paths.

    python tools/check_triton_gpu.py [--tokens 8192] [--vocab 131072] [--skip-tests]

Step 1 runs tests/losses/test_triton.py with TRITON_INTERPRET unset, so the kernel is compiled for
the GPU and checked against the float64 reference. Step 2 times forward+gradient of triton (fresh
buffer and in place), compiled and the eager float32 reference on bf16 logits with
`triton.testing.do_bench` (median) and prints a table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastlm.losses.spec import LossNormalizers, LossSpec, LossTargets  # noqa: E402 - after the path fix


def run_tests() -> int:
    """The triton test file in a child process without TRITON_INTERPRET; its exit status."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "pytest", "-q", "-s", str(ROOT / "tests/losses/test_triton.py")]
    print("$", " ".join(command), flush=True)
    return subprocess.call(command, cwd=ROOT, env=env)


def _cases(tokens: int, vocab: int) -> tuple[torch.Tensor, LossTargets, LossNormalizers]:
    """bf16 logits, 1 in 7 labels masked, policy inputs, 512-token documents."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(tokens, vocab, device="cuda", generator=generator, dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=generator)
    labels[::7] = -100
    old_logp = -torch.rand(tokens, device="cuda", generator=generator) * 12.0
    advantages = torch.randn(tokens, device="cuda", generator=generator)
    document_ids = torch.arange(tokens, device="cuda") // 512
    targets = LossTargets(labels, old_logp, advantages, document_ids)
    mask = labels != -100
    normalizers = LossNormalizers(float(mask.sum()), float(document_ids[mask].unique().numel()))
    return logits, targets, normalizers


def benchmark(tokens: int, vocab: int) -> None:
    # Imported here, after TRITON_INTERPRET is removed, so triton compiles for the GPU.
    from triton.testing import do_bench

    from fastlm.losses.compiled import compiled_loss
    from fastlm.losses.reference import reference_loss
    from fastlm.losses.spec import ClippedPolicySpec, GSPOSpec, WeightedSpec
    from fastlm.losses.triton import triton_loss

    logits, targets, normalizers = _cases(tokens, vocab)
    specs = {
        "ce": LossSpec(cross_entropy=WeightedSpec("ce", 1.0)),
        "ce+z+grpo": LossSpec(
            cross_entropy=WeightedSpec("ce", 1.0), z_loss=WeightedSpec("z", 1e-4), grpo=ClippedPolicySpec("grpo", 1.0, 0.2, 0.2)
        ),
        "gspo+z": LossSpec(z_loss=WeightedSpec("z", 1e-4), gspo=GSPOSpec("gspo", 1.0, 3e-4, 4e-4)),
    }
    buffer = logits.clone()
    moved = 3 * logits.numel() * logits.element_size()  # two reads of the logits, one gradient write

    def eager(spec: LossSpec) -> Callable[[], None]:
        def step() -> None:
            z = logits.float().requires_grad_()
            reference_loss(z, targets, normalizers, spec).loss.backward()

        return step

    print(f"\ntokens={tokens} vocab={vocab} bf16 logits, forward+gradient, median ms (do_bench)")
    print(f"{'spec':<12} {'implementation':<16} {'ms':>9} {'GB/s*':>9} {'grad rel err vs compiled':>26}")
    for name, spec in specs.items():
        _, reference_grad = compiled_loss(logits, targets, normalizers, spec)
        candidates: dict[str, Callable[[], object]] = {
            "triton": lambda: triton_loss(logits, targets, normalizers, spec),
            "triton inplace": lambda: triton_loss(buffer, targets, normalizers, spec, inplace=True),
            "compiled": lambda: compiled_loss(logits, targets, normalizers, spec),
            "eager fp32 ref": eager(spec),
        }
        for label, function in candidates.items():
            error = ""
            if label == "triton":
                _, grad = triton_loss(logits, targets, normalizers, spec)
                diff = (grad.float() - reference_grad.float()).norm() / reference_grad.float().norm()
                error = f"{float(diff):.2e}"
            try:
                milliseconds = do_bench(function, warmup=25, rep=100, return_mode="median")
            except torch.OutOfMemoryError:
                print(f"{name:<12} {label:<16} {'OOM':>9}")
                torch.cuda.empty_cache()
                continue
            print(f"{name:<12} {label:<16} {milliseconds:9.3f} {moved / milliseconds / 1e6:9.0f} {error:>26}", flush=True)
        torch.cuda.empty_cache()
    print("* GB/s counts 3 passes over the bf16 logits (two reads, one write) for every row alike.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device; on CPU run the tests under TRITON_INTERPRET=1 instead", file=sys.stderr)
        return 2
    if os.environ.pop("TRITON_INTERPRET", None) is not None:
        print("TRITON_INTERPRET was set; unset for this run so the kernel is compiled")
    status = 0 if args.skip_tests else run_tests()
    benchmark(args.tokens, args.vocab)
    return status


if __name__ == "__main__":
    sys.exit(main())
