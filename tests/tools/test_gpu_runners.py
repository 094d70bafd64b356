"""The GPU runners in tools/gpu/ parse as bash, take their time budget as the first argument, and tools/ names
things by what they measure (no issue numbers, no machine names)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
RUNNERS = sorted(path for path in (TOOLS / "gpu").glob("*.sh") if path.name != "run_all.sh")


@pytest.mark.parametrize("script", sorted((TOOLS / "gpu").glob("*.sh")), ids=lambda path: path.name)
def test_runner_parses(script: Path) -> None:
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("script", RUNNERS, ids=lambda path: path.name)
def test_runner_takes_its_budget_as_first_argument(script: Path) -> None:
    """run_all.sh hands each runner its seconds as $1: the runner documents it and reads it."""
    text = script.read_text()
    assert f"bash tools/gpu/{script.name} [BUDGET_S]" in text, f"{script.name}: its usage line should show [BUDGET_S]"
    assert re.search(r"\$\{1:-\d+\}", text), f"{script.name}: should read its budget from $1 with a default"


def test_tool_names_say_what_they_measure() -> None:
    names = [path.relative_to(TOOLS).as_posix() for path in TOOLS.rglob("*") if path.is_file()]
    assert names, "tools/ is empty"
    process_names = [name for name in names if re.search(r"issue|session|h100|h200", name, re.IGNORECASE)]
    assert not process_names, f"tool names from the process, not the purpose: {process_names}"
