"""The BMDB handle: connect, migrate, start sessions, read."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from sqlalchemy.engine import Engine

from bmdb import history
from bmdb.backlog import Thresholds
from bmdb.database import Tx, create_engine, ping, run_transaction
from bmdb.sessions import Session
from bmdb.sweep import SweepResult, sweep

if TYPE_CHECKING:
    from alembic.config import Config

T = TypeVar("T")
MIGRATIONS = Path(__file__).parent / "migrations"


class BMDB:
    """One database, shared by every session of this process (the engine pools connections)."""

    def __init__(self, url: str, thresholds: Thresholds | None = None,
                 pool_size: int = 5) -> None:
        self.url = url
        self.engine: Engine = create_engine(url, pool_size)
        self.thresholds = thresholds or Thresholds()

    def migrate(self, revision: str = "head") -> None:
        """Bring the schema up to ``revision`` with Alembic."""
        from alembic import command

        command.upgrade(alembic_config(self.url), revision)

    def downgrade(self, revision: str = "base") -> None:
        from alembic import command

        command.downgrade(alembic_config(self.url), revision)

    def start_session(self, component: str, interval: float = 5.0) -> Session:
        return Session(self, component, interval)

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


def connect(url: str, *, migrate: bool = False, thresholds: Thresholds | None = None,
            pool_size: int = 5) -> BMDB:
    """A handle on the BMDB at ``url`` (migrated to the newest schema with ``migrate``)."""
    db = BMDB(url, thresholds, pool_size)
    if migrate:
        db.migrate()
    return db


def alembic_config(url: str) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config
