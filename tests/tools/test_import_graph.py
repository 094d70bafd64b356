"""tools/import_graph.py finds the imports that point up a floor, the package cycles and the file cycles, on a real
package tree."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
import_graph = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = import_graph  # dataclasses look their module up while the class is made
spec.loader.exec_module(import_graph)

FLOORS = """# architecture

## Floors
| floor | packages |
| --- | --- |
| 0 | `base` |
| 1 | low, side |
| 2 | high |
| 3 | commands |

## Next section
| 9 | ignored |
"""


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "arch.md").write_text(FLOORS)
    return root


def test_upward_lazy_type_checking_and_cycles(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _package(tmp_path, {
        "__init__.py": "",
        "__main__.py": "from pkg.high import run\n",
        "base/__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": ("from typing import TYPE_CHECKING\nfrom pkg.base import x\nif TYPE_CHECKING:\n"
                     "    from pkg.high.b import Never\n\ndef f():\n    from pkg.high.b import lazy\n"),
        "side/__init__.py": "from . import c\nfrom ..low import a\n",
        "high/__init__.py": "",
        "high/b.py": "import pkg.low.a\nimport pkg.side\n",
    })
    assert import_graph.read_floors(tmp_path / "arch.md") == {"base": 0, "low": 1, "side": 1, "high": 2, "commands": 3}
    code = import_graph.main(["--root", str(root), "--floors", str(tmp_path / "arch.md"), "--max-upward", "1"])
    out = capsys.readouterr().out
    assert "upward imports: 1 " in out  # the lazy one; the TYPE_CHECKING import does not run
    assert "pkg/low/a.py:7  low (1) -> high (2): pkg.high.b  [lazy]" in out
    assert "package cycles: 1\n  high <-> low" in out  # side -> low is one floor, relative, and no cycle
    assert code == 1  # a cycle fails --max-upward even within its count


def test_file_cycles_count_lazy_and_type_checking_imports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Files tied only by an import inside a function or under TYPE_CHECKING are a cycle; a one-way chain is not."""
    root = _package(tmp_path, {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from pkg.low import b\n",
        "low/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.low.a import f\n",
        "low/c.py": "from .a import f\nfrom pkg.low import b\n",
    })
    code = import_graph.main(["--root", str(root), "--floors", str(tmp_path / "arch.md"), "--max-file-cycles", "0"])
    out = capsys.readouterr().out
    assert "file cycles: 1\n  2 files: pkg.low.a, pkg.low.b\n" in out
    assert "pkg.low.a -> pkg.low.b  pkg/low/a.py:2" in out and "pkg.low.b -> pkg.low.a  pkg/low/b.py:3" in out
    assert "pkg.low.c" not in out  # c imports a and b, nothing imports c
    assert code == 1
    assert import_graph.main(["--root", str(root), "--floors", str(tmp_path / "arch.md"), "--max-file-cycles", "1"]) == 0


def test_a_package_without_a_floor_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _package(tmp_path, {"low/a.py": "from pkg.extra import y\n", "extra/__init__.py": ""})
    assert import_graph.main(["--root", str(root), "--floors", str(tmp_path / "arch.md")]) == 2
    assert "no floor for package(s) extra" in capsys.readouterr().out


def test_every_fastlm_package_has_a_floor(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/architecture.md's table places every package of the repository (a new one must be added there)."""
    assert import_graph.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("upward imports: ") and "package cycles: " in out


def test_fastlm_floors_point_down(capsys: pytest.CaptureFixture[str]) -> None:
    """The repository's own graph (issues 39 and 51): at most 2 imports up a floor, no package cycle, no file cycle."""
    code = import_graph.main(["--max-upward", "2", "--max-file-cycles", "0"])
    out = capsys.readouterr().out
    print(out)
    upward = int(out.split("upward imports: ")[1].split()[0])
    assert code == 0 and upward <= 2 and "package cycles: 0" in out and "file cycles: 0" in out
