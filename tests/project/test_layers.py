"""The layer order, checked on the source (an AST walk, no imports run).

``LAYERS`` lists the project's parts lowest first: the BMDB, then ``shepherd``'s
packages and top-level modules, then the Celery glue. A part may import its own layer
and the layers below, never one above. Every import counts, at module level or inside
a function (a lazy import is still an arrow), and inside ``if TYPE_CHECKING:`` too: a
type-only import from above still means the lower part knows the higher one's
concepts, and is a cycle the day someone needs it at run time.

A second rule: Celery (``celery``, ``kombu``) is known only to the glue (``tasks/``,
``celeryconfig.py``) and to the CLI's broker client (``shepherd/cli/workers.py``);
``shepherd/task_api.py`` names Celery's types for mypy only (under ``TYPE_CHECKING``).

Each rule is shown to catch what it forbids on a small snippet, so a green run means
the tree is clean, not that the check is blind. docs/ARCHITECTURE.md section 2 says
why the order is what it is.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

import pytest

from tests.support.source import (
    CODE,
    absolute,
    libraries_imported,
    module_name,
    parse,
    python_files,
    relative,
)

#: Lowest first. A part is a package (all its modules) or a module; ``shepherd`` itself
#: (its ``__init__``) and the packages not named stand apart (see ``part_of``).
LAYERS: tuple[tuple[str, ...], ...] = (
    # The BMDB: a library that knows nothing of Shepherd.
    ("bmdb",),
    # Words and tools every layer may use: files, secrets kept out of text, text
    # tables, OS processes, the tasks' declarations (names and parameters, no Celery),
    # the image catalog (inventories name its images, the server serves them, the
    # installation workflow requests them, the simulator lists its demo image there),
    # the operators' roles (the server enforces them, the CLI's API mode names them),
    # the frozen startup heap (the server and the workers freeze theirs), Ed25519 on
    # the heartbeat path (the server checks with it, the answer key signs with it).
    ("shepherd.files", "shepherd.redaction", "shepherd.text_tables", "shepherd.os_processes",
     "shepherd.task_api", "shepherd.images", "shepherd.roles", "shepherd.frozen_heap",
     "shepherd.ed25519"),
    # Settings: the state directory's file beneath the environment and the kinds of
    # values settings take, then ``Settings``.
    # The CLI's API mode's settings, read beside ``Settings`` without the BMDB; the
    # operators' API's routes and roles (the server, the web view and the CLI read them).
    ("shepherd.state_env", "shepherd.config_kinds", "shepherd.client_settings",
     "shepherd.api_routes"),
    ("shepherd.config",),
    # Programs of their own, run elsewhere: the agent (with its wire format) and the
    # simulator; Celery's configuration, derived from the settings.
    ("shepherd.agent", "shepherd.simulator", "celeryconfig"),
    # What both sides of a boundary need: the fleet's answer key (the server signs,
    # AgentStart hands it out, the installation derives host keys from it) and a BMC's
    # spec (providers carry it, power acts on it).
    ("shepherd.answer_key", "shepherd.bmc"),
    # The outside world: providers, power controls, the inventory (which serves
    # itself as a provider and names BMCs), SSH.
    ("shepherd.providers",),
    ("shepherd.power",),
    ("shepherd.inventory",),
    ("shepherd.remote",),
    # The rules: every workflow, the guard, Recovery claims, the machine work.
    ("shepherd.workflows",),
    # What operators and scrapers read and ask, over the workflows.
    ("shepherd.metrics", "shepherd.operations"),
    # One composition root per process.
    ("shepherd.runtime",),
    # The entry points: the callback server and web view, ``shepherd up``, the CLI.
    ("shepherd.server", "shepherd.up"),
    ("shepherd.cli",),
    # The Celery glue, over everything.
    ("tasks",),
)

#: Modules allowed to import Celery or kombu at run time.
CELERY_KNOWERS = ("tasks/", "celeryconfig.py", "shepherd/cli/workers.py")
#: Modules allowed to import Celery's types under ``TYPE_CHECKING`` only.
CELERY_TYPES_ONLY = ("shepherd/task_api.py",)
CELERY = ("celery", "kombu")


def part_of(module: str) -> str | None:
    """The ``LAYERS`` part ``module`` belongs to (the longest that prefixes it), or None."""
    names = [name for layer in LAYERS for name in layer
             if module == name or module.startswith(name + ".")]
    return max(names, key=len) if names else None


def layer_of(part: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if part in layer)


def imported(tree: ast.AST, name: str, is_package: bool) -> Iterator[tuple[str, int]]:
    """Every module ``name`` imports (absolute names, lazily or not, ``TYPE_CHECKING``
    included) with its line; ``from a import b`` yields both ``a`` and ``a.b`` (``b``
    may be a module)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = absolute(node, name, is_package)
            yield base, node.lineno
            yield from ((f"{base}.{alias.name}", node.lineno) for alias in node.names)


def upward_imports(tree: ast.AST, name: str, is_package: bool = False) -> list[str]:
    """``name``'s imports of a part in a higher layer than its own, as text."""
    own = part_of(name)
    if own is None:
        return []
    found = []
    for target, line in imported(tree, name, is_package):
        part = part_of(target)
        if part is not None and layer_of(part) > layer_of(own):
            found.append(f"{name}:{line} imports {target} ({part} is above {own})")
    return sorted(set(found))


def test_every_part_has_a_layer() -> None:
    """A new package or top-level module must be placed in ``LAYERS`` (and the
    architecture page) before it can be checked."""
    unplaced = sorted({module_name(path) for path in python_files(*CODE)
                       if part_of(module_name(path)) is None} - {"shepherd"})
    assert unplaced == [], "add these to LAYERS in tests/project/test_layers.py"


def test_no_import_from_a_higher_layer() -> None:
    offenders = [offence for path in python_files(*CODE)
                 for offence in upward_imports(parse(path), module_name(path),
                                               path.name == "__init__.py")]
    assert offenders == []


@pytest.mark.parametrize(("module", "source"), [
    ("shepherd.workflows.initializer", "from shepherd.server.answers import AnswerKey"),
    ("shepherd.providers.base",
     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from shepherd.power import x"),
    ("shepherd.up.state", "def f():\n    import tasks.broker_tables\n"),
    ("shepherd.workflows.guard", "from shepherd import runtime"),
    ("shepherd.power.exclusive", "from .. import inventory"),
    ("bmdb.work", "import shepherd.config"),
])
def test_the_layer_check_catches(module: str, source: str) -> None:
    assert upward_imports(ast.parse(source), module)


def test_the_layer_check_lets_lower_and_same_layer_imports_pass() -> None:
    source = ("import bmdb\nfrom shepherd.providers.base import Provider\n"
              "from shepherd.workflows import guard\nfrom . import common\nimport json\n")
    assert upward_imports(ast.parse(source), "shepherd.workflows.sourcing") == []


# -- Celery ------------------------------------------------------------------------------


def celery_imports(tree: ast.AST, types_only_allowed: bool = False) -> list[int]:
    """Lines importing Celery or kombu; with ``types_only_allowed``, those inside an
    ``if TYPE_CHECKING:`` block pass."""
    allowed = set()
    if types_only_allowed:
        allowed = {id(inner) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for inner in ast.walk(node)}
    return [node.lineno for node, names in libraries_imported(tree)
            if id(node) not in allowed and names & set(CELERY)]


def test_only_the_glue_knows_celery() -> None:
    offenders = [f"{relative(path)}:{line}" for path in python_files("bmdb", "shepherd")
                 if not relative(path).startswith(CELERY_KNOWERS)
                 for line in celery_imports(parse(path),
                                            relative(path) in CELERY_TYPES_ONLY)]
    assert offenders == [], "Celery belongs in tasks/ or celeryconfig.py"


@pytest.mark.parametrize("source", [
    "from kombu.transport.sqlalchemy.models import metadata",
    "def f():\n    from celery.backends.database.models import ResultModelBase\n",
    "import celery",
])
def test_the_celery_check_catches(source: str) -> None:
    assert celery_imports(ast.parse(source))
    assert celery_imports(ast.parse(source), types_only_allowed=True)


def test_the_celery_check_lets_type_only_imports_pass_where_allowed() -> None:
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from celery import Celery\n"
    assert celery_imports(ast.parse(source)) == [3]
    assert celery_imports(ast.parse(source), types_only_allowed=True) == []
