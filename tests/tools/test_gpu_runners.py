"""The GPU runners in tools/gpu/ parse as bash, take their time budget as the first argument, start from the one
shared preamble (tools/gpu/common.sh), and tools/ names things by what they measure (no issue numbers, no
machine names)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
COMMON = TOOLS / "gpu" / "common.sh"
RUNNERS = sorted(path for path in (TOOLS / "gpu").glob("*.sh") if path.name not in ("run_all.sh", COMMON.name))


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


@pytest.mark.parametrize("script", RUNNERS, ids=lambda path: path.name)
def test_runner_sources_the_common_preamble(script: Path) -> None:
    assert 'source "$(dirname "$0")/common.sh"' in script.read_text(), f"{script.name}: should source common.sh"


def test_common_preamble_helpers(tmp_path: Path) -> None:
    """Sourced from elsewhere, the preamble works from the repository root, makes $OUT, and its helpers time-box,
    log and keep each command's exit status."""
    out, log = tmp_path / "out", tmp_path / "out" / "x.log"
    script = (f'BUDGET=100; OUT={out}; LOG={log}; source {COMMON}; pwd; echo "left $(left) min $(min 7 3)"; '
              'run 5 echo skipped; run 20 sh -c "echo hello; exit 3"; printf "%s\n" "${SUMMARY[@]}"')
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == str(TOOLS.parent), lines
    _, left, _, smaller = lines[1].split()
    assert 90 <= int(left) <= 100 and smaller == "3", lines
    logged = log.read_text()
    assert "skipped (no time left): echo skipped" in logged and "hello" in logged and "exit 3: sh -c" in logged
    assert lines[-1] == "exit 3: sh -c echo hello; exit 3", lines


def test_tool_names_say_what_they_measure() -> None:
    names = [path.relative_to(TOOLS).as_posix() for path in TOOLS.rglob("*") if path.is_file()]
    assert names, "tools/ is empty"
    process_names = [name for name in names if re.search(r"issue|session|h100|h200", name, re.IGNORECASE)]
    assert not process_names, f"tool names from the process, not the purpose: {process_names}"
