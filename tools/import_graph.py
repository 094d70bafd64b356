"""The package import graph of fastlm against its floors: every import that points up a floor, and every cycle.

    python tools/import_graph.py                      # fastlm/ against docs/architecture.md's "Floors" table
    python tools/import_graph.py --max-upward 2       # exit 1 with more upward imports than 2, or any cycle

The floors are the table under `## Floors` in the markdown file (`| floor | packages |`, lowest first). A
package is a folder under the root; top-level modules (__main__.py) are the `commands` package. Every
`import fastlm.X` / `from fastlm.X import` counts, also lazy ones inside functions (they run when the
function does), except those under `if TYPE_CHECKING:` (never run). A cycle is a set of packages that reach
one another through imports, whatever their floors.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL_PACKAGE = "commands"  # what a module directly under the root (__main__.py) belongs to


@dataclass(frozen=True)
class Import:
    path: Path  # the importing file
    line: int
    source: str  # the importing package
    target: str  # the imported package
    module: str  # the imported module, dotted
    lazy: bool  # inside a function body


def read_floors(markdown: Path) -> dict[str, int]:
    """Package -> floor from the table under `## Floors` (rows `| 3 | data, models |`)."""
    floors: dict[str, int] = {}
    section = re.search(r"^## Floors\n(.*?)(?=^## |\Z)", markdown.read_text(), re.M | re.S)
    if section is None:
        raise SystemExit(f"{markdown}: no '## Floors' section")
    for row in re.finditer(r"^\|\s*(\d+)\s*\|([^|]+)\|", section.group(1), re.M):
        for name in row.group(2).split(","):
            floors[name.strip().strip("`")] = int(row.group(1))
    if not floors:
        raise SystemExit(f"{markdown}: the '## Floors' section has no '| floor | packages |' rows")
    return floors


def package_of(module: str, root_name: str) -> str | None:
    """`fastlm.data.batch` -> `data`; `fastlm.__main__` -> `commands`; a module outside the root -> None."""
    parts = module.split(".")
    if parts[0] != root_name or len(parts) < 2:
        return None
    return parts[1] if parts[1] != "__main__" else TOP_LEVEL_PACKAGE


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_modules(node: ast.Import | ast.ImportFrom, this_module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level == 0:
        return [node.module or ""]
    base = this_module.split(".")[: len(this_module.split(".")) - node.level + (1 if is_package else 0)]
    return [".".join(base + ([node.module] if node.module else []))]


def file_imports(path: Path, root: Path) -> list[Import]:
    """The imports of one file that reach another package of the root."""
    relative = path.relative_to(root.parent).with_suffix("")
    is_package = relative.name == "__init__"
    this_module = ".".join(relative.parts[:-1] if is_package else relative.parts)
    source = package_of(this_module, root.name) if len(relative.parts) > 2 else TOP_LEVEL_PACKAGE
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for other in child.orelse:
                    visit_one(other, lazy)
                continue
            visit_one(child, lazy)

    def visit_one(child: ast.AST, lazy: bool) -> None:
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            for module in _imported_modules(child, this_module, is_package):
                target = package_of(module, root.name)
                if target is not None and target != source:
                    found.append(Import(path, child.lineno, source, target, module, lazy))
        visit(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(), str(path)), lazy=False)
    return found


def package_cycles(imports: list[Import]) -> list[list[str]]:
    """Strongly connected sets of two or more packages (Tarjan), each sorted."""
    graph: dict[str, set[str]] = defaultdict(set)
    for item in imports:
        graph[item.source].add(item.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                cycles.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(cycles)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT / "fastlm", help="the package folder")
    parser.add_argument("--floors", type=Path, default=ROOT / "docs" / "architecture.md",
                        help="markdown file with the '## Floors' table")
    parser.add_argument("--max-upward", type=int, default=None,
                        help="exit 1 when more imports than this point up, or any package cycle exists")
    args = parser.parse_args(argv)

    floors = read_floors(args.floors)
    imports = [item for path in sorted(args.root.rglob("*.py")) for item in file_imports(path, args.root)]
    unplaced = sorted({name for item in imports for name in (item.source, item.target)} - floors.keys())
    if unplaced:
        print(f"{args.floors}: no floor for package(s) {', '.join(unplaced)}: add them to the '## Floors' table")
        return 2

    upward = [item for item in imports if floors[item.target] > floors[item.source]]
    print(f"upward imports: {len(upward)} (floors from {args.floors.name})")
    for item in upward:
        where = item.path.relative_to(args.root.parent)
        print(f"  {where}:{item.line}  {item.source} ({floors[item.source]}) -> {item.target} "
              f"({floors[item.target]}): {item.module}{'  [lazy]' if item.lazy else ''}")
    edges = sorted({(item.source, item.target) for item in upward})
    print(f"upward package edges: {len(edges)}" + "".join(f"\n  {a} -> {b}" for a, b in edges))
    cycles = package_cycles(imports)
    print(f"package cycles: {len(cycles)}" + "".join(f"\n  {' <-> '.join(cycle)}" for cycle in cycles))
    if args.max_upward is not None and (len(upward) > args.max_upward or cycles):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
