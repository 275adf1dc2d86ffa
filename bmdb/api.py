"""The BMDB handle: connect, migrate, start sessions, read."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from sqlalchemy.engine import Engine

from bmdb.backlog import Thresholds
from bmdb.database import Tx, create_engine, run_transaction
from bmdb.sessions import Session
from bmdb.sweep import SweepResult, sweep

T = TypeVar("T")
MIGRATIONS = Path(__file__).parent / "migrations"


class BMDB:
    """One database, shared by every session of this process (the engine pools connections)."""

    def __init__(self, url: str, thresholds: Thresholds | None = None) -> None:
        self.url = url
        self.engine: Engine = create_engine(url)
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

    def sweep(self) -> SweepResult:
        return sweep(self.engine)

    def close(self) -> None:
        self.engine.dispose()


def connect(url: str, *, migrate: bool = False, thresholds: Thresholds | None = None) -> BMDB:
    db = BMDB(url, thresholds)
    if migrate:
        db.migrate()
    return db


def alembic_config(url: str):
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config
