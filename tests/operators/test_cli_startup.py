"""The CLI starts without what it does not use (issue 14).

``shepherd`` spent over half a second importing Celery, Flask, SSH, the BMC drivers and
more before reading one row. Start-up time is not asserted here (timings flake on a
shared machine; ``bench/`` and the issue's closing note hold the figures); what makes it
is: which modules a command loads, checked in a fresh interpreter. Building the parser
(and ``--help``) loads no database library at all; a read loads SQLAlchemy and the
BMDB, and none of the worker, server, SSH, BMC or migration libraries.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

import bmdb
from shepherd import cli
from shepherd.cli.arguments import Runner
from tests.support.operator_fixtures import seed_fleet

#: Libraries (and our own modules) that only workers, servers, SSH, BMC or migration
#: commands need, or API mode: no direct read and no parser may load them.
HEAVY = (
    "a2wsgi", "alembic", "celery", "celeryconfig", "cryptography", "fabric", "flask",
    "flower", "httptools", "invoke", "jinja2", "kombu", "mako", "nacl", "paramiko",
    "prometheus_client", "pydantic", "pydantic_core", "pyghmi", "pygments", "requests",
    "rich", "starlette", "sushy", "tasks", "urllib3", "uvicorn", "uvloop", "werkzeug",
    "yaml", "shepherd.metrics", "shepherd.power", "shepherd.remote", "shepherd.server",
    "shepherd.workflows.initializer", "shepherd.workflows.recoverer",
    # API mode's HTTP client, with email and ssl: loaded only to send a command.
    "http.client", "shepherd.cli.api_http",
)
#: What the parser needs no more than ``--help`` does.
DATABASE = ("bmdb", "psycopg2", "sqlalchemy")

#: Runs each command line of argv[1] in one interpreter and prints, per command, its
#: exit status and the modules of argv[2] loaded so far.
PROBE = """
import contextlib, io, json, sys
from shepherd.cli.main import main

def loaded(names):
    return sorted(m for m in sys.modules
                  if any(m == n or m.startswith(n + ".") for n in names))

commands, forbidden = json.loads(sys.argv[1]), json.loads(sys.argv[2])
seen = {}
for argv in commands:
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            status = main(argv)
        except SystemExit as end:
            status = end.code
    seen[" ".join(argv)] = [status, loaded(forbidden)]
print(json.dumps(seen))
"""


def probe(commands: list[list[str]], forbidden: tuple[str, ...]) -> dict[str, list]:
    """``{command line: [exit status, forbidden modules it loaded]}``, from a fresh
    interpreter (this one has loaded everything already)."""
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(commands),
                           json.dumps(forbidden)],
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout)


def test_the_parser_and_help_load_no_database_and_no_heavy_library() -> None:
    seen = probe([["--help"], ["machines", "--help"], ["frobnicate"]], HEAVY + DATABASE)
    assert seen == {"--help": [0, []], "machines --help": [0, []], "frobnicate": [2, []]}


def test_read_commands_load_only_their_backend(db: bmdb.BMDB, session: bmdb.Session,
                                               db_url: str) -> None:
    fleet = seed_fleet(db, session)
    url = ["--bmdb-url", db_url]
    commands = [[*url, "machines"], [*url, "fleet"], [*url, "sessions"],
                [*url, "show", str(fleet.healthy)], [*url, "--json", "machines"]]
    seen = probe(commands, HEAVY)
    assert seen == {" ".join(argv): [0, []] for argv in commands}


def test_help_still_lists_every_command(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    shown = capsys.readouterr().out
    missing = [name for name, _ in commands(cli.parser()) if name.split()[0] not in shown]
    assert missing == []


def test_every_command_names_a_function_that_exists() -> None:
    """Runners are names until a command runs; a typo would surface only then."""
    runners = {name: parser.get_default("run") for name, parser in commands(cli.parser())}
    lazy = {name: run for name, run in runners.items() if isinstance(run, Runner)}
    assert {"machines", "fleet", "show", "migrate", "start"} <= set(lazy)
    assert [name for name, run in lazy.items() if not callable(run.resolve())] == []


def commands(parser: argparse.ArgumentParser, prefix: str = "") -> Iterator[
        tuple[str, argparse.ArgumentParser]]:
    """Every (sub)command that runs something, as ``("inventory check", parser)``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if sub.get_default("run") is not None:
                    yield f"{prefix}{name}", sub
                yield from commands(sub, f"{prefix}{name} ")
