"""`tools/bench_train.py --lora --cpu-smoke` (here in-process): the four setups run at the tiny shape and print
their table; our LoRA and HF PEFT's train the same number of adapter values (timings are not asserted)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import bench_train  # noqa: E402 - after tools/ joins the path


def test_bench_lora_cpu_smoke(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_train.py", "--lora", "--cpu-smoke"])
    assert bench_train.main() == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("| tiny-llama | 32 | 2 |")]
    rows = {cells[4].strip(): cells for cells in (line.split("|") for line in lines)}
    assert sorted(rows) == ["full", "lora", "lora+ac", "peft"], out
    assert all(float(row[7].replace(",", "")) > 0 for row in rows.values())
    assert rows["lora"][5] == rows["peft"][5] != rows["full"][5]  # trainable values: adapters only, as PEFT's
