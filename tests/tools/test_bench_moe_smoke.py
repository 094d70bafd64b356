"""The MoE benchmark's CPU mode runs end to end: layer rows for fastlm's grouped, Triton (interpreted) and loop
paths and transformers' block, each one's error against the loop, and whole-model rows beside the dense twin
(timings not asserted), and --profile's tables: each model's step split into categories that add up to its
busy time. A row's error may be exactly 0 (one CPU thread: the Triton interpreter's and torch's
GEMMs sum each small dot product in the same order), so the benchmark's check that each backend's own GEMMs
ran is tested too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import bench_moe  # noqa: E402 - after tools/ joins the path

from fastlm.layers.moe import MoEMLP, triton_grouped_mm_supported  # noqa: E402


@pytest.fixture(scope="module")
def result() -> subprocess.CompletedProcess[str]:
    """One CPU smoke run with --profile for the tests below (the interpreted Triton row takes seconds)."""
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_moe.py"), "--cpu-smoke", "--models", "mixtral-tiny", "--profile"],
        capture_output=True, text=True, timeout=300, check=True,
    )


def test_bench_moe_cpu_smoke(result: subprocess.CompletedProcess[str]) -> None:
    rows = [line.split("|") for line in result.stdout.splitlines() if line.startswith("| ")]
    layer = {row[2].strip(): row for row in rows if row[1].strip().startswith("E8 k2")}
    assert {"fastlm grouped", "fastlm triton", "fastlm loop", "transformers eager"} <= set(layer), result.stdout
    assert "did not run" not in result.stdout, result.stdout  # each fastlm row's own GEMMs produced its output
    assert all(float(row[3]) > 0 for row in layer.values())
    for name in ("fastlm grouped", "fastlm triton", "transformers eager"):
        out_error, dx_error = (float(value) for value in layer[name][5].split("/"))
        assert out_error < 1e-5 and dx_error < 1e-5, name  # float32 on CPU: every path equals the loop
    models = {row[1].strip(): row for row in rows if row[1].strip().startswith("mixtral-tiny")}
    assert set(models) == {"mixtral-tiny dense twin", "mixtral-tiny grouped", "mixtral-tiny loop"}, result.stdout
    millions = {name: (float(row[2].strip(" M")), float(row[3].strip(" M"))) for name, row in models.items()}
    total, active = millions["mixtral-tiny grouped"]
    assert active < total and abs(millions["mixtral-tiny dense twin"][0] - active) <= 0.1  # twin: the active size
    assert all(float(row[4].replace(",", "")) > 0 for row in models.values())


def test_bench_moe_profile_tables(result: subprocess.CompletedProcess[str]) -> None:
    """Each profiled model's categories are all listed and sum to its busy time within 5%; the grouped GEMMs'
    row holds the MoE model's torch._grouped_mm and nothing of the dense twin's; the extra table subtracts them."""
    categories = [category for category, _ in bench_moe.CATEGORY_RULES] + [bench_moe.OTHER_CATEGORY]
    tables: dict[str, dict[str, float]] = {}
    section = ""
    for line in result.stdout.splitlines():
        if line.startswith(("profile of ", "where the extra time goes")):
            section = line.split(":")[0].removeprefix("profile of ")
            tables[section] = {}
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if section and cells and cells[0] in [*categories, "total (busy)"]:
            tables[section][cells[0]] = float(cells[3] if section.startswith("where") else cells[1])
    extra = tables.pop("where the extra time goes")
    assert set(tables) == {"mixtral-tiny dense twin", "mixtral-tiny grouped"}, result.stdout
    for name, table in tables.items():
        assert list(table) == [*categories, "total (busy)"], name
        total = table.pop("total (busy)")
        assert total > 0 and abs(sum(table.values()) - total) <= 0.05 * total, (name, table, total)
    dense, moe = tables["mixtral-tiny dense twin"], tables["mixtral-tiny grouped"]
    assert dense["grouped GEMMs"] == 0 < moe["grouped GEMMs"]
    assert list(extra) == categories
    assert all(abs(extra[category] - (moe[category] - dense[category])) <= 2e-3 for category in categories)


@pytest.mark.skipif(not triton_grouped_mm_supported(torch.device("cpu"), torch.float32),
                    reason="the Triton interpreter needs TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")
def test_expert_gemm_path_names_the_gemms_that_ran() -> None:
    """The check behind a layer row: each backend's output graph names its own GEMMs, so a backend that fell back
    to another path (or an error of 0 that is not bitwise agreement) cannot pass as a measurement."""
    torch.manual_seed(0)
    layer = MoEMLP(16, 8, 4, 2, True)
    layer.reset_parameters(0.02, 0.02)
    x = torch.randn(12, 16, requires_grad=True)
    for backend in ("grouped", "triton", "loop"):
        layer.backend = backend
        assert bench_moe.expert_gemm_path(layer(x)) == backend
