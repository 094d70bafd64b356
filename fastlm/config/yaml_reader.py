"""Bounded YAML: reading a config can neither hang, exhaust memory, nor end in a traceback.

A config file must be a regular file (not a FIFO, device or directory) of at most `MAX_CONFIG_BYTES`,
in UTF-8. Parsing is libyaml's (linear, fast) feeding PyYAML's composer, which here counts nesting
depth (a Python recursion limit would otherwise be a traceback) and, before anything is constructed,
the size of the document with every alias expanded: an alias bomb (a few hundred bytes that expand to
billions of nodes) and a self-referencing alias are refused with the line. A key given twice in one
mapping is an error naming the key, the file and both lines (YAML would silently keep the last one).
Every problem is a `ConfigError`.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import yaml
from yaml.composer import Composer
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.nodes import MappingNode, Node, SequenceNode
from yaml.resolver import Resolver

from fastlm.config.errors import ConfigError, ConfigIssue

try:
    from yaml._yaml import CParser as _Parser
except ImportError:  # PyYAML built without libyaml: the pure-Python reader, scanner and parser
    from yaml.parser import Parser
    from yaml.reader import Reader
    from yaml.scanner import Scanner

    class _Parser(Reader, Scanner, Parser):  # type: ignore[no-redef]
        def __init__(self, stream: str) -> None:
            Reader.__init__(self, stream)
            Scanner.__init__(self)
            Parser.__init__(self)


MAX_CONFIG_BYTES = 1 << 20  # a config is a few KiB; 1 MiB leaves room for generated ones
MAX_DEPTH = 64  # the schema nests about 6 deep
MAX_NODES = 200_000  # scalars + collections with aliases expanded (a 20,000-key file has 40,001)
MERGE_TAG = "tag:yaml.org,2002:merge"


class _Refused(yaml.MarkedYAMLError):
    """Well-formed YAML that a config may not be: too deep, too large expanded, a duplicate key."""


class _BoundedLoader(Composer, _Parser, SafeConstructor, Resolver):
    """SafeLoader semantics with limits on depth and expanded size, and duplicate keys refused."""

    def __init__(self, stream: str) -> None:
        _Parser.__init__(self, stream)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)
        Composer.__init__(self)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Refused(None, None, f"nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_document(self, node: Node) -> Any:
        _expanded_size(node, {}, set())
        return super().construct_document(node)

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as error:  # e.g. a 5000-digit integer, a 13th month
            raise ConstructorError(None, None, str(error), node.start_mark) from None

    def construct_mapping(self, node: Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line)
                except TypeError:  # unhashable: the base class raises its own error for it
                    continue
                if first != key_node.start_mark.line:
                    raise _Refused(None, None, f"duplicate key {key!r} (first given on line {first + 1}); "
                                           "YAML would silently keep the last one", key_node.start_mark)
        return super().construct_mapping(node, deep)


def _expanded_size(node: Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """Nodes in the document once every alias is replaced by a copy (each node is sized once: linear)."""
    known = sizes.get(id(node))
    if known is not None:
        return known
    if id(node) in open_nodes:
        raise _Refused(None, None, "an alias refers to a collection that contains it (a cycle)",
                               node.start_mark)
    open_nodes.add(id(node))
    if isinstance(node, SequenceNode):
        children: list[Node] = node.value
    elif isinstance(node, MappingNode):
        children = [child for pair in node.value for child in pair]
    else:
        children = []
    size = 1
    for child in children:
        size += _expanded_size(child, sizes, open_nodes)
        if size > MAX_NODES:
            raise _Refused(None, None, f"expands to more than {MAX_NODES:,} values (anchors and aliases "
                                   "multiply what they reference)", node.start_mark)
    open_nodes.discard(id(node))
    sizes[id(node)] = size
    return size


def parse_yaml(text: str, name: str) -> Any:
    """One YAML document from `text`; `name` (a file, or "override") is what errors point at."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "somewhere"
        problem = " ".join(part for part in (error.context, error.problem) if part)
        kind = "" if isinstance(error, _Refused) else "not valid YAML: "
        raise ConfigError(ConfigIssue("", f"{name} {where}: {kind}{problem}")) from None
    except yaml.YAMLError as error:
        raise ConfigError(ConfigIssue("", f"{name} is not valid YAML: {error}")) from None
    finally:
        loader.dispose()


def read_config_file(path: Path, source: str) -> str:
    """The text of a config file: a regular file (never a pipe or device, which could hang or never
    end), at most `MAX_CONFIG_BYTES`, in UTF-8. `source` names who asked for it (a base list, the CLI)."""
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(ConfigIssue("", f"{path} is not a regular file", source=source,
                                          hint="a config and its bases must be YAML files"))
        with path.open("rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(ConfigIssue("", f"config file not found: {path}", source=source)) from None
    except OSError as error:
        raise ConfigError(ConfigIssue("", f"cannot read config file {path}: {error.strerror or error}",
                                      source=source)) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(ConfigIssue("", f"{path} is larger than {MAX_CONFIG_BYTES // 1024} KiB; not a config file?",
                                      source=source))
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise ConfigError(ConfigIssue("", f"{path} line {line}: not valid UTF-8 (byte {error.start})",
                                      source=source, hint="save the file as UTF-8")) from None
