"""Reading the project's own source for the structure tests (tests/project/): which
files, under which module names, parsed, and where a relative import points. No
project code is imported or run."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The project's own code (tests, bench and migrations are checked where a rule says).
CODE = ("bmdb", "shepherd", "tasks", "celeryconfig.py")


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


def absolute(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    """The module ``from ... import`` in module ``name`` names, relative levels resolved."""
    if not node.level:
        return node.module or ""
    package = name.split(".") if is_package else name.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def libraries_imported(tree: ast.AST) -> Iterator[tuple[ast.stmt, set[str]]]:
    """Each import statement (at module level or lazily) with the top-level names of
    the absolute modules it imports: ``import a.b, c`` -> {"a", "c"}."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield node, {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            yield node, {(node.module or "").split(".")[0]}
