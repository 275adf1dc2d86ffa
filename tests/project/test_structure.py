"""The architecture's rules, checked on the source (an AST walk, no imports run):

* ``Settings`` (shepherd/config.py) is the only reader of the environment, apart from
  the agent and the simulator, which are separate programs;
* SQLAlchemy and Alembic are the BMDB's own: nothing outside ``bmdb/`` imports them
  (the tests and the benchmarks aside: they build raw SQL on purpose, to corrupt a row,
  pin a connection or time a statement);
* ``bmdb``'s face is its ``__init__``: it exports no submodule, and nothing outside
  ``bmdb/`` (but the tests) names one, ``bmdb._schema`` (the table layout) included;
* no import cycle anywhere, ``bmdb/`` included.

Each rule is shown to catch what it forbids on a small snippet, so a green run means
the tree is clean, not that the check is blind.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import TypeGuard

import pytest

from tests.support.source import (
    CODE,
    ROOT,
    absolute,
    libraries_imported,
    module_name,
    parse,
    python_files,
    relative,
)

#: Outside the BMDB: what may use its face only.
OUTSIDE_BMDB = ("shepherd", "tasks", "celeryconfig.py")
ENVIRONMENT_READERS = ("shepherd/config.py", "shepherd/client_settings.py", "shepherd/agent/",
                       "shepherd/simulator/")


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


# -- SQLAlchemy is the BMDB's -----------------------------------------------------------

BMDB_LIBRARIES = ("sqlalchemy", "alembic")


def database_library_imports(tree: ast.AST) -> list[int]:
    """Lines that import SQLAlchemy or Alembic, at module level or lazily."""
    return [node.lineno for node, names in libraries_imported(tree)
            if names & set(BMDB_LIBRARIES)]


def test_only_bmdb_imports_sqlalchemy() -> None:
    offenders = [f"{relative(path)}:{line}" for path in python_files(*OUTSIDE_BMDB)
                 for line in database_library_imports(parse(path))]
    assert offenders == [], "ask bmdb (a verb, bmdb.Unavailable, bmdb.parse_url) instead"


@pytest.mark.parametrize("source", [
    "import sqlalchemy as sa", "from sqlalchemy.exc import OperationalError",
    "import sqlalchemy.exc", "def f():\n    import sqlalchemy\n",
    "from alembic import command",
])
def test_the_sqlalchemy_check_catches(source: str) -> None:
    assert database_library_imports(ast.parse(source))


def test_the_sqlalchemy_check_spares_look_alikes() -> None:
    assert not database_library_imports(ast.parse("import sqlalchemy_utils_not\n"
                                                  "from . import sqlalchemy\n"))


# -- bmdb's face ------------------------------------------------------------------------

#: ``bmdb``'s submodules and subpackages, by name (``_schema``, ``tags``, ``migrations``).
BMDB_SUBMODULES = frozenset(
    path.stem if path.is_file() else path.name for path in (ROOT / "bmdb").iterdir()
    if (path.suffix == ".py" and path.stem != "__init__")
    or (path.is_dir() and (path / "__init__.py").exists()))


def submodule_uses(tree: ast.AST, submodules: frozenset[str] = BMDB_SUBMODULES) -> list[int]:
    """Lines that name a submodule of ``bmdb``: ``import bmdb.x``, ``from bmdb.x import
    ...``, ``from bmdb import x``, ``bmdb.x``."""
    return [node.lineno for node in ast.walk(tree) if _names_submodule(node, submodules)]


def _names_submodule(node: ast.AST, submodules: frozenset[str]
                     ) -> TypeGuard[ast.Import | ast.ImportFrom | ast.Attribute]:
    if isinstance(node, ast.Import):
        return any(a.name.startswith("bmdb.") for a in node.names)
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").startswith("bmdb.") or (
            node.module == "bmdb" and any(a.name in submodules for a in node.names))
    return (isinstance(node, ast.Attribute) and node.attr in submodules
            and isinstance(node.value, ast.Name) and node.value.id == "bmdb")


def test_nothing_outside_bmdb_names_its_submodules() -> None:
    offenders = [f"{relative(path)}:{line}"
                 for path in python_files(*OUTSIDE_BMDB, "bench")
                 for line in submodule_uses(parse(path))]
    assert offenders == [], "use bmdb.<name> (bmdb/__init__.py) instead of bmdb.<module>"


@pytest.mark.parametrize("source", [
    "import bmdb._schema", "from bmdb import _schema", "from bmdb._schema import work",
    "import bmdb\nt = bmdb._schema.work", "import bmdb\nbmdb.tags.create_machine(tx)",
    "from bmdb.fleet import FleetCounts", "from bmdb import Process, queries",
])
def test_the_submodule_check_catches(source: str) -> None:
    assert submodule_uses(ast.parse(source))


def test_the_submodule_check_spares_the_face() -> None:
    assert not submodule_uses(ast.parse("import bmdb\nfrom bmdb import Process, Tx\n"
                                        "bmdb.create_machine(tx)\nbmdb.Process.RECOVERY"))


def exported_submodules(tree: ast.Module, submodules: frozenset[str] = BMDB_SUBMODULES
                        ) -> list[str]:
    """Submodules a package's ``__init__`` binds as names of its own (``from bmdb import
    tags``, ``import bmdb.tags as tags``) or lists in ``__all__``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "bmdb":
            found += [a.asname or a.name for a in node.names if a.name in submodules]
        elif isinstance(node, ast.Import):
            found += [a.asname for a in node.names
                      if a.asname and a.name.startswith("bmdb.")]
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            found += [e.value for e in ast.walk(node.value)
                      if isinstance(e, ast.Constant) and e.value in submodules]
    return found


def test_bmdb_exports_no_submodule() -> None:
    init = parse(ROOT / "bmdb" / "__init__.py")
    assert exported_submodules(init) == [], "export the verbs and records, not the module"
    import bmdb

    assert not [name for name in bmdb.__all__ if name in BMDB_SUBMODULES]


@pytest.mark.parametrize("source", [
    "from bmdb import tags", "from bmdb import _schema as schema",
    "import bmdb.fleet as fleet", "__all__ = ['Process', 'queries']",
])
def test_the_export_check_catches(source: str) -> None:
    assert exported_submodules(ast.parse(source))


# -- import cycles ---------------------------------------------------------------------


def imports(tree: ast.Module, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The project modules ``name`` imports, lazily or not; ``TYPE_CHECKING`` blocks
    aside (they never run)."""
    found: set[str] = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = absolute(node, name, is_package)
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


def test_no_import_cycle() -> None:
    assert cycles(import_graph(CODE)) == []


def test_bmdb_vocabulary_is_at_the_bottom() -> None:
    """Its words are what every module of ``bmdb`` needs: importing any of them back
    would be the first step of a circle."""
    assert import_graph(("bmdb",))["bmdb.vocabulary"] == set()


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
