"""What the benchmarks share: a PostgreSQL to run on and a fresh, migrated database."""

from __future__ import annotations

import argparse
import contextlib
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
    """A fresh database URL, on the given server or on a throw-away one (fsync on, like prod)."""
    with contextlib.ExitStack() as cleanup:
        if admin_url is None:
            server = PostgresServer(fsync=True).start()
            cleanup.callback(server.destroy)  # even when the steps below fail
            admin_url = server.url
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
