"""``bmdb.connect``: the pool size is the caller's (no environment read in ``bmdb``), and
``BMDB.ping`` answers the health check."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

import bmdb
from tests.support.servers import free_port


def test_pool_size_is_the_callers(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHEPHERD_BMDB_POOL_SIZE", "9")  # ignored: Settings reads it
    db = bmdb.connect(pg_url, pool_size=3)
    try:
        pool = db.engine.pool
        assert isinstance(pool, sa.pool.QueuePool)
        assert pool.size() == 3
    finally:
        db.close()
    db = bmdb.connect(pg_url)
    try:
        pool = db.engine.pool
        assert isinstance(pool, sa.pool.QueuePool)
        assert pool.size() == 5
    finally:
        db.close()


def test_ping(db: bmdb.BMDB) -> None:
    db.ping()


def test_ping_raises_when_the_database_does_not_answer() -> None:
    db = bmdb.connect(f"postgresql+psycopg2://nobody@127.0.0.1:{free_port()}/none")
    try:
        with pytest.raises(sa.exc.OperationalError):
            db.ping()
    finally:
        db.close()
