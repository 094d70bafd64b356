"""The import graph of fastlm against its floors: every import that points up a floor, every package cycle
and every file cycle.

    python tools/import_graph.py                      # fastlm/ against docs/architecture.md's "Floors" table
    python tools/import_graph.py --max-upward 2       # exit 1 with more upward imports than 2, or any package cycle
    python tools/import_graph.py --max-file-cycles 0  # exit 1 with more file cycles than 0

The floors are the table under `## Floors` in the markdown file (`| floor | packages |`, lowest first). A
package is a folder under the root; top-level modules (__main__.py) are the `commands` package. Every
`import fastlm.X` / `from fastlm.X import` counts, also lazy ones inside functions (they run when the
function does), except those under `if TYPE_CHECKING:` (never run). A cycle is a set of packages that reach
one another through imports, whatever their floors.

A file cycle is a set of modules (files) that reach one another through imports; here every import counts,
those inside functions and those under `if TYPE_CHECKING:` too (a type-only import back still ties the two
files: neither can be read, moved or tested alone). `from fastlm.a import b` is an import of the module
`fastlm.a.b` when that file exists, else of `fastlm.a` (its `__init__.py`).
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


def _module_name(path: Path, root: Path) -> tuple[str, bool]:
    """`root/data/batch.py` -> (`fastlm.data.batch`, False); `root/data/__init__.py` -> (`fastlm.data`, True)."""
    relative = path.relative_to(root.parent).with_suffix("")
    is_package = relative.name == "__init__"
    return ".".join(relative.parts[:-1] if is_package else relative.parts), is_package


def _walk_imports(path: Path, root: Path) -> list[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    """Every import statement of a file, with (lazy: inside a function, type_only: under TYPE_CHECKING)."""
    found: list[tuple[ast.Import | ast.ImportFrom, bool, bool]] = []

    def visit(node: ast.AST, lazy: bool, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for body in child.body:
                    visit_one(body, lazy, True)
                for other in child.orelse:
                    visit_one(other, lazy, type_only)
                continue
            visit_one(child, lazy, type_only)

    def visit_one(child: ast.AST, lazy: bool, type_only: bool) -> None:
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            found.append((child, lazy, type_only))
        visit(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)), type_only)

    visit(ast.parse(path.read_text(), str(path)), lazy=False, type_only=False)
    return found


def file_imports(path: Path, root: Path) -> list[Import]:
    """The imports of one file that reach another package of the root and run (not under TYPE_CHECKING)."""
    this_module, is_package = _module_name(path, root)
    source = package_of(this_module, root.name) if len(path.relative_to(root.parent).parts) > 2 else TOP_LEVEL_PACKAGE
    found: list[Import] = []
    for node, lazy, type_only in _walk_imports(path, root):
        if type_only:
            continue
        for module in _imported_modules(node, this_module, is_package):
            target = package_of(module, root.name)
            if target is not None and target != source:
                found.append(Import(path, node.lineno, source, target, module, lazy))
    return found


def module_graph(root: Path) -> dict[str, dict[str, str]]:
    """Module -> {imported module of the root: where (`path:line`, the first import)}, every import counted."""
    paths = {_module_name(path, root)[0]: path for path in sorted(root.rglob("*.py"))}
    graph: dict[str, dict[str, str]] = {}
    for this_module, path in paths.items():
        is_package = path.name == "__init__.py"
        edges = graph.setdefault(this_module, {})
        for node, _, _ in _walk_imports(path, root):
            named = [alias.name for alias in node.names] if isinstance(node, ast.ImportFrom) else [""]
            for module in _imported_modules(node, this_module, is_package):
                for name in named:
                    target = f"{module}.{name}" if name and f"{module}.{name}" in paths else module
                    while target and target not in paths:  # `import fastlm.a.b.func`-like names: their file
                        target = target.rpartition(".")[0]
                    if target and target != this_module:
                        edges.setdefault(target, f"{path.relative_to(root.parent)}:{node.lineno}")
    return graph


def strong_components(graph: dict[str, set[str]] | dict[str, dict[str, str]]) -> list[list[str]]:
    """Strongly connected sets of two or more nodes (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                cycles.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(cycles)


def package_cycles(imports: list[Import]) -> list[list[str]]:
    """Strongly connected sets of two or more packages, each sorted."""
    graph: dict[str, set[str]] = defaultdict(set)
    for item in imports:
        graph[item.source].add(item.target)
    return strong_components(graph)


def file_cycles(root: Path) -> list[tuple[list[str], list[str]]]:
    """Each file cycle: its modules and the imports that tie them (`a -> b  path:line`)."""
    graph = module_graph(root)
    found = []
    for members in strong_components(graph):
        inside = set(members)
        edges = [f"{a} -> {b}  {graph[a][b]}" for a in members for b in sorted(graph[a]) if b in inside]
        found.append((members, edges))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT / "fastlm", help="the package folder")
    parser.add_argument("--floors", type=Path, default=ROOT / "docs" / "architecture.md",
                        help="markdown file with the '## Floors' table")
    parser.add_argument("--max-upward", type=int, default=None,
                        help="exit 1 when more imports than this point up, or any package cycle exists")
    parser.add_argument("--max-file-cycles", type=int, default=None,
                        help="exit 1 when there are more file cycles than this")
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
    files = file_cycles(args.root)
    print(f"file cycles: {len(files)}")
    for members, edges in files:
        print(f"  {len(members)} files: {', '.join(members)}" + "".join(f"\n    {edge}" for edge in edges))
    if args.max_upward is not None and (len(upward) > args.max_upward or cycles):
        return 1
    if args.max_file_cycles is not None and len(files) > args.max_file_cycles:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
