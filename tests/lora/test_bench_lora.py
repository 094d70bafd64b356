"""`tools/bench_train.py --lora --cpu-smoke`: the four setups run at the tiny shape and print their table; our LoRA
and HF PEFT's train the same number of adapter values (timings are not asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_lora_cpu_smoke() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_train.py"), "--lora", "--cpu-smoke"],
                            capture_output=True, text=True, timeout=600, check=True)
    lines = [line for line in result.stdout.splitlines() if line.startswith("| tiny-llama | 32 | 2 |")]
    rows = {cells[4].strip(): cells for cells in (line.split("|") for line in lines)}
    assert sorted(rows) == ["full", "lora", "lora+ac", "peft"], result.stdout
    assert all(float(row[7].replace(",", "")) > 0 for row in rows.values())
    assert rows["lora"][5] == rows["peft"][5] != rows["full"][5]  # trainable values: adapters only, as PEFT's
