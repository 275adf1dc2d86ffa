"""The BMDB handle: connect, migrate, start sessions, read."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping
from typing import TypeVar

from sqlalchemy.engine import Engine

from bmdb import history, revisions
from bmdb._database import Tx, create_engine, ping, run_transaction
from bmdb.backlog import Thresholds
from bmdb.backoff import Backoff, default_backoff
from bmdb.sessions import Session
from bmdb.sweep import SweepResult, sweep
from bmdb.vocabulary import Process

T = TypeVar("T")


class BMDB:
    """One database, shared by every session of this process (the engine pools connections)."""

    def __init__(self, url: str, thresholds: Thresholds | None = None,
                 pool_size: int = 5, backoffs: Mapping[Process, Backoff] | None = None
                 ) -> None:
        self.url = url
        self.engine: Engine = create_engine(url, pool_size)
        self.thresholds = thresholds or Thresholds()
        #: A process's backoff when a failure names none (``backoff_for``).
        self.backoffs = dict(backoffs or {})

    def backoff_for(self, process: Process) -> Backoff:
        """The backoff a failure of ``process`` gets when its workflow names none: the
        configured one (``connect(backoffs=)``), else the built-in default."""
        return self.backoffs.get(process) or default_backoff(process)

    def migrate(self, revision: str = "head") -> None:
        """Bring the schema up to ``revision`` (``revisions.migrate``)."""
        revisions.migrate(self.url, revision)

    def downgrade(self, revision: str = "base") -> None:
        revisions.downgrade(self.url, revision)

    def revisions(self) -> list[str]:
        """The schema revisions the database is at (none before the first migration)."""
        return revisions.current_revisions(self.engine)

    def start_session(self, component: str, interval: float = 5.0, *,
                      durable: bool = True) -> Session:
        """A session (``Session`` says what ``durable=False`` gives up, and for whom)."""
        return Session(self, component, interval, durable=durable)

    def read(self, body: Callable[[Tx], T]) -> T:
        """Run ``body`` in a transaction outside any session: for reads, and for the sweep."""
        return run_transaction(self.engine, body)

    def ping(self) -> None:
        """Raise unless the database answers one round trip now (for health checks)."""
        ping(self.engine)

    def sweep(self) -> SweepResult:
        return sweep(self.engine)

    def prune_history(self, older_than: dt.datetime, batch_size: int, *,
                      max_batches: int | None = None,
                      after_batch: Callable[[int], None] | None = None) -> int:
        """Delete history older than ``older_than`` in short transactions (see
        ``history.prune``: never the guard's last hour); how many rows went."""
        return history.prune(self.engine, older_than, batch_size, max_batches=max_batches,
                             after_batch=after_batch)

    def close(self) -> None:
        self.engine.dispose()

    def forget_inherited_connections(self) -> None:
        """After a fork, in the child: forget the pooled connections without closing
        them, so the parent keeps using its sockets; new ones are opened on first use."""
        self.engine.dispose(close=False)


def connect(url: str, *, migrate: bool = False, thresholds: Thresholds | None = None,
            pool_size: int = 5, backoffs: Mapping[Process, Backoff] | None = None) -> BMDB:
    """A handle on the BMDB at ``url`` (migrated to the newest schema with ``migrate``),
    judging silence by ``thresholds`` and backing failures off by ``backoffs`` (per
    process; the built-in defaults for the rest)."""
    db = BMDB(url, thresholds, pool_size, backoffs)
    if migrate:
        db.migrate()
    return db

