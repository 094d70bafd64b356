"""The `fastlm` command starts fast: `--help` and a mistyped command import no torch, and `validate`
imports nothing of torch.compile (torch._dynamo alone costs 1-4 s on a loaded machine). Checked by the
modules a fresh interpreter holds, which stay true on a loaded machine where wall times do not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REPORT = "import sys; print('MODULES', *sorted(name for name in sys.modules if name.startswith(('torch', 'transformers'))))"


def run_cli(arguments: list[str], tmp_path: Path) -> tuple[int, set[str], str]:
    """Runs `main(arguments)` in a fresh interpreter; its exit code, the torch/transformers modules it
    imported, and its stderr."""
    script = (f"import sys\nfrom fastlm.commands.main import main\ntry:\n    code = main({arguments!r})\n"
              f"except SystemExit as stop:\n    code = stop.code\n{REPORT}\nsys.exit(code)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=300)
    modules = next(line for line in done.stdout.splitlines() if line.startswith("MODULES")).split()[1:]
    return done.returncode, set(modules), done.stderr


@pytest.mark.parametrize("arguments", [["--help"], ["trian", "x.yaml"], ["validate", "--help"]], ids=" ".join)
def test_help_and_a_wrong_command_import_no_torch(arguments: list[str], tmp_path: Path) -> None:
    code, modules, stderr = run_cli(arguments, tmp_path)
    assert code == (2 if arguments[0] == "trian" else 0), stderr
    if arguments[0] == "trian":
        assert "invalid choice: 'trian'" in stderr
    assert not modules, f"`fastlm {' '.join(arguments)}` imported {sorted(modules)[:5]}"


def test_validate_imports_no_torch_compile(tmp_path: Path) -> None:
    code, modules, stderr = run_cli(["validate", str(ROOT / "configs/presets/tiny-llama.yaml")], tmp_path)
    assert code == 0, stderr
    assert "torch" in modules
    assert not {name for name in modules if name.startswith(("torch._dynamo", "torch._inductor", "transformers"))}
