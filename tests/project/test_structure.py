"""The architecture's rules, checked on the source (an AST walk, no imports run):

* ``Settings`` (shepherd/config.py) is the only reader of the environment, apart from
  the agent and the simulator, which are separate programs;
* the table layout is the BMDB's own: nothing outside ``bmdb/`` (its migrations
  included) and the tests imports ``bmdb.schema``;
* no import cycle outside ``bmdb/``.

Each rule is shown to catch what it forbids on a small snippet, so a green run means
the tree is clean, not that the check is blind.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import TypeGuard

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: The project's own code (tests, bench and migrations are checked where a rule says).
CODE = ("bmdb", "shepherd", "tasks", "celeryconfig.py")
ENVIRONMENT_READERS = ("shepherd/config.py", "shepherd/agent/", "shepherd/simulator/")


def python_files(*roots: str) -> Iterator[Path]:
    for root in roots:
        path = ROOT / root
        yield from [path] if path.is_file() else sorted(path.rglob("*.py"))


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


# -- the environment -------------------------------------------------------------------


def environment_reads(tree: ast.AST) -> list[int]:
    """Lines that read or change the process environment."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "environb", "getenv",
                                                             "putenv", "unsetenv"):
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                found.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                alias.name in ("environ", "getenv", "environb") for alias in node.names):
            found.append(node.lineno)
    return found


def test_only_settings_read_the_environment() -> None:
    offenders = [f"{relative(path)}:{line}" for path in python_files(*CODE)
                 if not relative(path).startswith(ENVIRONMENT_READERS)
                 for line in environment_reads(parse(path))]
    assert offenders == [], "read the environment through shepherd.config.Settings"


@pytest.mark.parametrize("source", [
    "import os\nx = os.environ['A']", "import os\nx = os.getenv('A')",
    "from os import environ", "import os\nos.environ.get('A')",
])
def test_the_environment_check_catches(source: str) -> None:
    assert environment_reads(ast.parse(source))


# -- the table layout ------------------------------------------------------------------


def schema_uses(tree: ast.AST) -> list[int]:
    return [node.lineno for node in ast.walk(tree) if _names_schema(node)]


def _names_schema(node: ast.AST) -> TypeGuard[ast.Import | ast.ImportFrom | ast.Attribute]:
    """``import bmdb.schema``, ``from bmdb(.schema) import ...schema...``, ``bmdb.schema``."""
    if isinstance(node, ast.Import):
        return any(a.name.startswith("bmdb.schema") for a in node.names)
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").startswith("bmdb.schema") or (
            node.module == "bmdb" and any(a.name == "schema" for a in node.names))
    return (isinstance(node, ast.Attribute) and node.attr == "schema"
            and isinstance(node.value, ast.Name) and node.value.id == "bmdb")


def test_only_bmdb_knows_the_table_layout() -> None:
    offenders = [f"{relative(path)}:{line}"
                 for path in python_files("shepherd", "tasks", "celeryconfig.py", "bench")
                 for line in schema_uses(parse(path))]
    assert offenders == [], "use a named query function in bmdb/ instead of bmdb.schema"


@pytest.mark.parametrize("source", [
    "import bmdb.schema", "from bmdb import schema", "from bmdb.schema import work",
    "import bmdb\nt = bmdb.schema.work",
])
def test_the_schema_check_catches(source: str) -> None:
    assert schema_uses(ast.parse(source))


# -- import cycles ---------------------------------------------------------------------


def imports(tree: ast.Module, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The project modules ``name`` imports, lazily or not; ``TYPE_CHECKING`` blocks
    aside (they never run)."""
    found: set[str] = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, name, is_package)
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                      for a in node.names}
    return {module for module in found if module in known and module != name}


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def _absolute(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = name.split(".") if is_package else name.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def import_graph(roots: tuple[str, ...]) -> dict[str, set[str]]:
    paths = {module_name(path): path for path in python_files(*roots)}
    known = set(paths)
    return {name: imports(parse(path), name, path.name == "__init__.py", known)
            for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_outside_bmdb() -> None:
    found = [c for c in cycles(import_graph(CODE))
             if not all(m == "bmdb" or m.startswith("bmdb.") for m in c)]
    assert found == []


def test_the_cycle_check_catches_a_lazy_circle() -> None:
    graph = {"shepherd.metrics": {"shepherd.runtime"},
             "shepherd.runtime": {"shepherd.providers.equinix"},
             "shepherd.providers.equinix": {"shepherd.metrics"}, "shepherd.cli": set()}
    assert cycles(graph) == [["shepherd.metrics", "shepherd.providers.equinix",
                              "shepherd.runtime"]]
    lazy = ast.parse("def f():\n    from shepherd import metrics\n")
    known = {"shepherd", "shepherd.metrics"}
    assert imports(lazy, "shepherd.runtime", False, known) == {"shepherd.metrics"}
    guarded = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                        "    from shepherd import metrics\n")
    assert imports(guarded, "shepherd.runtime", False, known) == set()
