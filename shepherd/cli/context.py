"""What every operator command is handed: the parsed arguments, the settings (built once,
from the environment and the flags), and what is built from them on first use.

This is the CLI's composition root. Commands never read the environment or build a
BMDB handle of their own, so ``shepherd explain`` sees the same thresholds and guard
limits as the workers and ``shepherd serve`` (all three start from ``Settings``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bmdb
from shepherd import config, operations, state_env
from shepherd.cli.workers import CeleryWorkers, WorkerLayer
from shepherd.config import Settings
from shepherd.redaction import database_url_problem, redact_url
from shepherd.runtime import Runtime
from shepherd.workflows.guard import GuardLimits

URL_SHAPE = "dialect[+driver]://user[:password]@host[:port]/database or sqlite:///path"
#: The BMDB session name of operator commands that change something.
COMPONENT = "operator-cli"


class Failed(Exception):
    """The command could not be done now; the message is the one line to show (exit 1)."""


class Context:
    """One command's world. ``close()`` ends what was started (session, pool)."""

    def __init__(self, args: argparse.Namespace, settings: Settings,
                 workers: Callable[[Settings], WorkerLayer] = CeleryWorkers) -> None:
        self.args = args
        self.settings = settings
        self._workers_factory = workers
        self._runtime: Runtime | None = None

    @classmethod
    def build(cls, args: argparse.Namespace,
              workers: Callable[[Settings], WorkerLayer] = CeleryWorkers) -> Context:
        """Settings from the environment, ``--bmdb-url`` over them."""
        settings = Settings.from_env()
        if getattr(args, "bmdb_url", None):
            settings = dataclasses.replace(settings, bmdb_url=args.bmdb_url)
        return cls(args, settings, workers)

    @property
    def runtime(self) -> Runtime:
        """The runtime, once the BMDB URL was checked (so a bad one is one clear line)."""
        if self._runtime is None:
            if self.url_source == "the default" and self.args.command != "migrate" \
                    and not default_bmdb_exists():
                raise operations.BadArgument(outside_any_state())
            check_bmdb_url(self.settings.bmdb_url, self.url_source)
            self._runtime = Runtime(self.settings, COMPONENT)
        return self._runtime

    @property
    def db(self) -> bmdb.BMDB:
        return self.runtime.db

    def guard_limits(self) -> GuardLimits:
        """The guard's limits exactly as workers build them; only the health check's
        wait is bounded, as a person is waiting."""
        return self.runtime.guard_limits(interactive=True)

    def workers(self) -> WorkerLayer:
        """The worker layer; refused in one line when the broker is a stopped
        ``shepherd up``'s (its workers are gone: the work would wait for nobody)."""
        source = config.source_of("SHEPHERD_BROKER_URL")
        if source is not None and source != "SHEPHERD_BROKER_URL":
            directory = config.state_dir()
            if state_env.running_up(directory) is None:
                raise Failed(f"shepherd up is not running on {directory.resolve()}, so no "
                             "worker reads the broker it chose: start it again "
                             "(`shepherd up`), or set SHEPHERD_BROKER_URL")
        return self._workers_factory(self.settings)

    @property
    def url_source(self) -> str:
        """Where the BMDB URL came from, for messages about it."""
        if getattr(self.args, "bmdb_url", None):
            return "--bmdb-url"
        return config.source_of("SHEPHERD_BMDB_URL") or "the default"

    def stopped_up(self) -> Path | None:
        """The state directory of the ``shepherd up`` whose BMDB this command reads,
        when that ``up`` no longer runs; None otherwise (a BMDB of one's own, or ``up``
        running). Why: its figures stay as last written ("heartbeating 20" until the
        heartbeat timeout passes), and a reader should know nothing runs."""
        if self.url_source in ("--bmdb-url", "SHEPHERD_BMDB_URL", "the default"):
            return None
        directory = config.state_dir()
        return None if state_env.running_up(directory) is not None else directory

    def machine_id(self) -> uuid.UUID:
        """The machine the command names (``args.machine``): its UUID at once, else
        resolved in one read (``operations.resolve_machine``)."""
        name: str = self.args.machine
        try:
            return uuid.UUID(name.strip())
        except ValueError:
            return self.db.read(lambda tx: operations.resolve_machine(tx, name))

    @property
    def json(self) -> bool:
        """Whether the command answers JSON (``--json``): then what only its table
        shows need not be read."""
        return bool(getattr(self.args, "json", False))

    def emit(self, data: Any, text: Callable[[], str]) -> None:
        """``data`` as one JSON document with ``--json``, else ``text()`` for people."""
        if self.json:
            print(json.dumps(operations.jsonable(data), default=str))
        else:
            print(text())

    def close(self) -> None:
        if self._runtime is not None:
            self._runtime.close()


def default_bmdb_exists() -> bool:
    """Whether the embedded default BMDB (SQLite under ./var) is there to be used."""
    return Path(bmdb.parse_url(Settings().bmdb_url).database or "").exists()


def outside_any_state() -> str:
    """Why a command run outside any ``shepherd up`` state, without a BMDB URL, stops:
    the embedded default is only meaningful where a BMDB was made (``shepherd up``,
    ``shepherd migrate``), and elsewhere SQLite would make an empty database and
    answer "no such table"."""
    where = (config.state_dir() / state_env.FILE_NAME).resolve()
    return (f"no BMDB to use: no SHEPHERD_BMDB_URL, no --bmdb-url, and no `shepherd up` "
            f"state here ({where} does not exist); run where `shepherd up` runs, or pass "
            f"--state DIR, or set SHEPHERD_BMDB_URL")


def check_bmdb_url(text: str, source: str) -> None:
    """Raise ``BadArgument`` naming what is wrong with the BMDB URL.

    Why before connecting: SQLAlchemy's errors for a bad URL read like a schema problem
    (and were answered with "is it migrated?"), and a URL whose user info SQLAlchemy
    would read differently (an unencoded '@' in the password) would be answered with
    a connection error naming part of the password as the host. Every message shows
    the URL through ``redact_url`` only.
    """
    shown = redact_url(text)
    problem = database_url_problem(text)
    if problem is not None:
        raise operations.BadArgument(f"the BMDB URL from {source}, {shown!r}: {problem}")
    try:
        bmdb.load_driver(bmdb.parse_url(text))
    except bmdb.UnknownDialect as error:
        raise operations.BadArgument(f"the BMDB URL from {source}, {shown!r}: {error} "
                                   f"({URL_SHAPE})") from None
    except bmdb.DriverMissing as error:
        raise operations.BadArgument(f"the BMDB URL from {source}, {shown!r}: {error}"
                                   ) from None
    except bmdb.BadURL:
        raise operations.BadArgument(f"the BMDB URL from {source}, {shown!r}, is not "
                                   f"a database URL ({URL_SHAPE})") from None

