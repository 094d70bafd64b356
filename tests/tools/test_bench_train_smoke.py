"""The training benchmark's CPU mode runs end to end and prints its table (timings are not asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_train_cpu_smoke_prints_plain_and_packed_rows_beside_transformers() -> None:
    """`--cpu-smoke --hf`: fastlm's plain and packed rows, a transformers row after each, the side-by-side table."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_train.py"), "--cpu-smoke", "--hf"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    rows = [line.split("|") for line in result.stdout.splitlines() if line.startswith("| tiny-llama | compiled |")]
    assert [(row[3].strip(), row[4].strip()) for row in rows] == [("plain", "causal"), ("packed", "dense")], result.stdout
    assert all(float(row[8].replace(",", "")) > 0 for row in rows)
    theirs = [line.split("|") for line in result.stdout.splitlines() if line.startswith("| tiny-llama | transformers")]
    assert [row[3].strip() for row in theirs] == ["plain", "packed"], result.stdout
    assert all(float(row[8].replace(",", "")) > 0 for row in theirs)
    assert "liger_kernel" in result.stdout and "| speedup |" in result.stdout


def test_bench_train_compare_cli_decomposes_the_gap() -> None:
    """`--compare-cli` at the tiny CPU shape: rows A-F (bench loop, its loop on the CLI loader's batches, the
    Trainer's step without and with read points, `fastlm train`'s logged windows, the loop again), each with
    two timed windows; the attribution, the profile of A, B and C, and the setups' differences."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_train.py"), "--compare-cli", "--cpu-smoke"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    out = result.stdout
    cells = [line.split("|") for line in out.splitlines() if line.startswith("| ")]
    rows = {row[1].strip(): row for row in cells if row[1].strip() in set("ABCDEF")}
    assert sorted(rows) == list("ABCDEF"), out
    for name, row in rows.items():
        windows = row[3].split("/")
        assert len(windows) == 2 and all(float(w.replace(",", "")) > 0 for w in windows), (name, out)
        assert row[8].strip() == "0", (name, out)  # no dynamo graph compiled while timing
    assert rows["A"][7].strip() == "1.000"
    assert "attribution of E - A" in out and "E / mean(A, F)" in out
    profiled = [line for line in out.splitlines() if line.startswith(("| A bench |", "| B bench+CLI data |", "| C trainer |"))]
    assert len(profiled) == 3, out
    assert "largest per-kernel changes, B bench+CLI data -> C trainer" in out
    differences = out[out.index("setup differences"):]
    assert "gradient clipping: none (no gradient norm) | 1.0" in differences, differences
    assert "FAILED" not in out


def test_bench_train_hf_loop_holds_the_same_weights() -> None:
    """The transformers model the side-by-side times computes fastlm's logits (same weights, same family)."""
    import torch

    sys.path.insert(0, str(ROOT / "tools"))
    from train_loops import HFLoop, model_config

    from fastlm.models import build_model

    torch.manual_seed(0)
    model = build_model(model_config("tiny-llama", "compiled", None).model, device="cpu").eval()
    reference = HFLoop(model, "plain", torch.device("cpu")).model.eval()
    ids = torch.randint(0, 260, (2, 16))
    with torch.no_grad():
        assert float((model.logits(ids) - reference(ids).logits).abs().max()) < 1e-5
