"""What the benchmarks share: a PostgreSQL to run on and a fresh, migrated database."""

from __future__ import annotations

import argparse
import contextlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

import bmdb
from tests.support.servers import PostgresServer

if TYPE_CHECKING:
    from psycopg2.extensions import cursor


def arguments(description: str) -> argparse.ArgumentParser:
    """The options every bench on PostgreSQL takes: where to run, and where to write its
    figures as JSON (what ``tests/project/test_bench_*.py`` read)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--pg-url",
        help="an existing PostgreSQL server (admin URL); default: a throw-away one with fsync on",
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    return parser


@contextlib.contextmanager
def postgres(admin_url: str | None) -> Iterator[str]:
    """A fresh database URL, on the given server or on a throw-away one (fsync on, like prod).
    The URL is read as the BMDB reads one (``bmdb.engine_url``): a bare
    ``postgresql://`` works here as it does for ``shepherd`` itself."""
    with contextlib.ExitStack() as cleanup:
        if admin_url is None:
            server = PostgresServer(fsync=True).start()
            cleanup.callback(server.destroy)  # even when the steps below fail
            admin_url = server.url
        admin_url = bmdb.engine_url(admin_url).render_as_string(hide_password=False)
        name = f"bench_{uuid.uuid4().hex[:12]}"
        admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
        cleanup.callback(admin.dispose)
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE {name}")
        cleanup.callback(_drop_database, admin, name)
        url = sa.make_url(admin_url).set(database=name).render_as_string(hide_password=False)
        bmdb.connect(url, migrate=True).close()
        yield url


def _drop_database(admin: sa.Engine, name: str) -> None:
    with admin.connect() as conn:
        conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def psycopg2_dsn(url: str) -> str:
    parsed = sa.make_url(url)
    return (
        f"host={parsed.host} port={parsed.port} user={parsed.username} dbname={parsed.database}"
    )


def fetch_one(cur: cursor) -> tuple[Any, ...]:
    """The row of a statement that always returns one (psycopg2's is optional)."""
    row = cur.fetchone()
    assert row is not None
    return row


def commits(url: str, others_gone_within: float = 0.0) -> int:
    """The database's committed transactions so far (``pg_stat_database``).

    A backend reports its counts at most once a second, and when it exits. So this
    waits 1.2 s first; or, with ``others_gone_within``, up to that many seconds for
    every other backend of the database to exit (the servers of a run that ended),
    which makes the count exact.
    """
    import psycopg2

    with contextlib.closing(psycopg2.connect(psycopg2_dsn(url))) as conn:
        conn.autocommit = True
        cur = conn.cursor()
        if not others_gone_within:
            time.sleep(1.2)
        deadline = time.monotonic() + others_gone_within
        while time.monotonic() < deadline:
            cur.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = "
                        "current_database() AND pid <> pg_backend_pid()")
            if fetch_one(cur)[0] == 0:
                break
            time.sleep(0.1)
        cur.execute("SELECT pg_stat_clear_snapshot()")
        cur.execute("SELECT xact_commit FROM pg_stat_database "
                    "WHERE datname = current_database()")
        return int(fetch_one(cur)[0])
