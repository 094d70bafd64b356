"""One long line through `fastlm prepare` and `fastlm train` (byte tokenizer), as real processes: peak memory
grows by about twice the line (it was 29 times in prepare and 42 in train for a 50 MB line).

Each command runs in a fresh process whose peak RSS (`ru_maxrss`) is read by a parent that runs nothing else;
the growth is measured against the same command on a one-line file of 2 MiB (long enough for prepare's
long-record reader: the same reading path, the same imports), per byte the big file adds."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from crash_harness import ROOT, write_config

from fastlm.data.long_records import LONG_RECORD_BYTES

BIG_BYTES = 40 * 10**6
BOUND = 2.5  # peak growth per byte of input
SMALL_BYTES = 2 * LONG_RECORD_BYTES
_MEASURE = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)")


def _one_line_jsonl(path: Path, size: int) -> Path:
    """One JSON object whose text (ASCII words, nothing to escape) makes the line `size` bytes."""
    rng = random.Random(size)
    block = " ".join("".join(rng.choice("etaoinshrdlu") for _ in range(rng.randint(1, 9))) for _ in range(200_000))
    body = size - len('{"text": ""}\n')
    text = (block * (body // len(block) + 1))[:body]
    path.write_text(json.dumps({"text": text}) + "\n", encoding="ascii")
    assert path.stat().st_size == size
    return path


def _peak_bytes(arguments: list[str], cwd: Path) -> int:
    process = subprocess.run([sys.executable, "-c", _MEASURE, sys.executable, "-m", "fastlm", *arguments], cwd=cwd,
                             env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                             capture_output=True, text=True, timeout=600)
    assert process.returncode == 0, process.stderr
    return int(process.stdout.split()[-1]) * 1024  # KiB on Linux


def _prepare(directory: Path, data: Path) -> list[str]:
    config = directory / f"prepare-{data.stem}.yaml"
    config.write_text(yaml.safe_dump({"input_path": str(data), "output_path": str(directory / f"set-{data.stem}")}))
    return ["prepare", str(config)]


def _train(directory: Path, data: Path) -> list[str]:
    config = write_config(directory, f"run-{data.stem}", steps=2, checkpoint_every=2,
                          source={"type": "jsonl", "path": str(data)})
    return ["train", str(config)]


def _growth_per_byte(tmp_path: Path, command, label: str) -> float:
    small, big = _one_line_jsonl(tmp_path / "small.jsonl", SMALL_BYTES), _one_line_jsonl(tmp_path / "big.jsonl", BIG_BYTES)
    base, peak = _peak_bytes(command(tmp_path, small), tmp_path), _peak_bytes(command(tmp_path, big), tmp_path)
    ratio = (peak - base) / (BIG_BYTES - SMALL_BYTES)
    print(f"{label}: a {BIG_BYTES / 1e6:.0f} MB line: peak RSS {peak / 1e6:.0f} MB, {base / 1e6:.0f} MB for a 2 MiB line: "
          f"{ratio:.2f} bytes per byte")
    return ratio


@pytest.mark.slow
def test_prepare_of_one_long_line_grows_by_about_twice_its_size(tmp_path: Path) -> None:
    assert _growth_per_byte(tmp_path, _prepare, "fastlm prepare") <= BOUND


@pytest.mark.slow
def test_train_on_one_long_line_grows_by_about_twice_its_size(tmp_path: Path) -> None:
    assert _growth_per_byte(tmp_path, _train, "fastlm train") <= BOUND
