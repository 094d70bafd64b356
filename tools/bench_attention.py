"""Attention for packed documents, forward + backward, every candidate side by side in one run (CUDA).

    python tools/bench_attention.py                        # llama-1b shape: B=4, 32/8 heads, S=2048, D=64, bf16
    python tools/bench_attention.py --heads 16 --kv-heads 8 --batch 8   # llama-350m shape
    python tools/bench_attention.py --batch 1 --heads 16 --kv-heads 8 --head-dim 128 --seq-len 131072 \
        --doc-min 16384 --doc-max 131072                # qwen3-1.7b at 128k: block-mask memory and speed

Candidates: SDPA is_causal (flash; ignores the documents: the speed to beat), SDPA with the dense
(B, 1, S, S) document mask (kv repeated per group), FlexAttention with the document block mask (the
training path; kernel options variants), varlen flash attention over the documents when this torch
has `torch.nn.attention.varlen`. Outputs of every masked candidate are checked against the dense path.
Documents: lengths uniform in [--doc-min, --doc-max] (mean ~300), packed into rows.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from train_loops import packed_document_ids  # noqa: E402 - tools/ is the script directory, on sys.path

from fastlm.layers.attention_kernels import flex_attend  # noqa: E402
from fastlm.layers.embedding import document_positions  # noqa: E402 - after the path fix
from fastlm.layers.packed_attention import attention_layout, document_mask_mod, flex_block_mask  # noqa: E402

DENSE_LIMIT_GIB = 4.0  # the dense candidate runs up to this mask size (a 128k row's is 16 GiB)


def time_ms(function, repeats: int = 20) -> float:
    """Median of CUDA-event times over `repeats` calls after 3 warm-ups."""
    for _ in range(3):
        function()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def varlen_candidate(q, k, v, document_ids):
    """varlen flash attention over the flattened documents, or None when this torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    batch, heads, seq_len, dim = q.shape
    positions = document_positions(document_ids.cuda()).reshape(-1)
    starts = torch.nonzero(positions == 0).flatten()
    cu = torch.cat([starts, torch.tensor([batch * seq_len], device=q.device)]).to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())
    flat = [t.transpose(1, 2).reshape(batch * seq_len, t.shape[1], dim).detach().requires_grad_() for t in (q, k, v)]
    parameters = inspect.signature(varlen_attn).parameters
    options = {}
    if "is_causal" in parameters:
        options["is_causal"] = True
    if "window_size" in parameters:
        options["window_size"] = (-1, 0)
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" not in parameters:
            return None
        options["enable_gqa"] = True

    def run():
        return varlen_attn(*flat, cu, cu, max_len, max_len, **options)

    def unflatten(out):
        return out.reshape(batch, seq_len, heads, dim).transpose(1, 2)

    return run, unflatten


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--doc-min", type=int, default=150)
    parser.add_argument("--doc-max", type=int, default=450)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    device, dtype = torch.device("cuda"), torch.bfloat16
    generator = torch.Generator().manual_seed(0)
    b, s, d = args.batch, args.seq_len, args.head_dim
    q = torch.randn(b, args.heads, s, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(b, args.kv_heads, s, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(b, args.kv_heads, s, d, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(q)
    documents = packed_document_ids(b, s, args.doc_min, args.doc_max, generator)
    positions = document_positions(documents).to(device)
    causal = attention_layout(b, s, None, None, device, head_dim=d)
    rows: list[dict] = []
    mask_gib = b * s * s / 2**30  # the dense (B, 1, S, S) bool mask, before SDPA's own buffers
    if mask_gib <= DENSE_LIMIT_GIB:
        dense = attention_layout(b, s, positions, None, device, kind="dense", head_dim=d)
        reference = dense.attend(q, k, v).float()
    else:  # 128k tokens: a 16 GiB mask; the flex rows are checked against the causal row's shape only
        dense = reference = None
        rows.append({"candidate": "sdpa dense document mask", "error": f"skipped: its mask alone is {mask_gib:.0f} GiB"})

    def add(name: str, forward, output_of=lambda out: out) -> None:
        def fwd_bwd():
            out = forward()
            torch.autograd.backward(out, output_of_grad(out))

        def output_of_grad(out):
            return grad if out.shape == grad.shape else grad.transpose(1, 2).reshape(out.shape)

        try:
            out = output_of(forward()).float()
            masked = name != "sdpa causal (no documents)" and reference is not None
            error = float((out - reference).norm() / reference.norm()) if masked else float("nan")
            forward_ms = time_ms(lambda: forward())
            total_ms = time_ms(fwd_bwd)
            rows.append({"candidate": name, "fwd_ms": forward_ms, "fwd_bwd_ms": total_ms, "rel_err_vs_dense": error})
        except Exception as error:  # noqa: BLE001 - a candidate this torch cannot run is reported, not fatal
            rows.append({"candidate": name, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"})
        print(rows[-1], flush=True)

    add("sdpa causal (no documents)", lambda: causal.attend(q, k, v))
    if dense is not None:
        add("sdpa dense document mask", lambda: dense.attend(q, k, v))
    block_mask = flex_block_mask(positions, None, b, s, device)
    mask_bytes = sum(t.numel() * t.element_size() for t in block_mask.as_tuple() if isinstance(t, torch.Tensor))
    rows.append({"candidate": "flex block mask memory", "error": f"{mask_bytes / 2**20:.1f} MiB for B={b}, S={s}"})
    add("flex document block mask", lambda: flex_attend(q, k, v, block_mask))
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask_mod = document_mask_mod(positions, None)
    for name, build in (
        ("flex block mask from documents (once per batch)", lambda: flex_block_mask(positions, None, b, s, device)),
        ("torch create_block_mask, compiled (peer)",
         lambda: create_block_mask(mask_mod, b, None, s, s, device=device, _compile=True)),
    ):
        rows.append({"candidate": name, "fwd_ms": time_ms(build)})
        print(rows[-1], flush=True)

    for options in ({"BLOCK_M": 128, "BLOCK_N": 64}, {"BLOCK_M": 64, "BLOCK_N": 64}, {"PRESCALE_QK": True}):
        compiled = torch.compile(flex_attention, dynamic=False)
        add(f"flex {options}",
            lambda c=compiled, o=options: c(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=o))
    varlen = varlen_candidate(q, k, v, documents)
    if varlen is None:
        rows.append({"candidate": "varlen",
                     "error": "torch.nn.attention.varlen.varlen_attn (with GQA) not in this torch"})
    else:
        run, unflatten = varlen
        add("varlen flash (documents)", run, unflatten)
    print(f"\nattention fwd+bwd, B={b} heads={args.heads}/{args.kv_heads} S={s} D={d} bf16, documents "
          f"{args.doc_min}-{args.doc_max} tokens; {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| candidate | fwd ms | fwd+bwd ms | rel err vs dense |\n| --- | --- | --- | --- |")
    for row in rows:
        if "error" in row:
            print(f"| {row['candidate']} | {row['error']} | | |")
        else:
            print(f"| {row['candidate']} | {row['fwd_ms']:.3f} | {row.get('fwd_bwd_ms', float('nan')):.3f} "
                  f"| {row.get('rel_err_vs_dense', float('nan')):.1e} |")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"bench_attention_h{args.heads}.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
