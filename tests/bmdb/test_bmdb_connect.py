"""``bmdb.connect``: the pool size is the caller's (no environment read in ``bmdb``),
``BMDB.ping`` answers the health check, a database out of reach is ``bmdb.Unavailable``
(never one of SQLAlchemy's errors), migrations and URLs are the package's verbs."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

import bmdb
from bmdb._database import run_transaction
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


def test_a_url_without_a_driver_connects_with_psycopg2(pg_url: str) -> None:
    """``postgresql://`` (and ``postgres://``), as libpq and every PostgreSQL tool write
    it, reaches the BMDB through the driver Shepherd ships, and the CLI's check of the URL
    reads it the same way."""
    assert pg_url.startswith("postgresql+psycopg2://")
    for scheme in ("postgresql", "postgres"):
        bare = scheme + pg_url.removeprefix("postgresql+psycopg2")
        assert bmdb.parse_url(bare).drivername == "postgresql+psycopg2"
        bmdb.load_driver(bmdb.parse_url(bare))
        db = bmdb.connect(bare)
        try:
            db.ping()
            assert db.engine.dialect.driver == "psycopg2"
        finally:
            db.close()


def test_ping(db: bmdb.BMDB) -> None:
    db.ping()


def test_ping_raises_when_the_database_does_not_answer() -> None:
    db = bmdb.connect(f"postgresql+psycopg2://nobody@127.0.0.1:{free_port()}/none")
    try:
        with pytest.raises(bmdb.Unavailable):
            db.ping()
    finally:
        db.close()


def test_a_transaction_on_a_database_out_of_reach_is_unavailable() -> None:
    db = bmdb.connect(f"postgresql+psycopg2://nobody@127.0.0.1:{free_port()}/none")
    try:
        # db.read is this with the 30 s every transaction has to ride out a restart.
        with pytest.raises(bmdb.Unavailable, match="refused") as raised:
            run_transaction(db.engine, lambda tx: None, give_up_after=1.0)
        assert isinstance(raised.value.__cause__, sa.exc.OperationalError)
    finally:
        db.close()


def test_an_unmigrated_database_is_unavailable_on_either_backend(pg_url: str,
                                                                  tmp_path: Path) -> None:
    for url in (pg_url, f"sqlite:///{tmp_path / 'empty.sqlite'}"):
        db = bmdb.connect(url)
        try:
            db.downgrade("base")
            with pytest.raises(bmdb.Unavailable):
                db.read(lambda tx: bmdb.machine_exists(tx, uuid.uuid4()))
            assert db.revisions() == []
            db.migrate()
            assert len(db.revisions()) == 1
        finally:
            db.close()


def test_a_refused_statement_is_not_unavailability(db: bmdb.BMDB) -> None:
    """A constraint the database enforced is an answer, not an outage: it passes as is."""
    def twice(tx: bmdb.Tx) -> None:
        machine = bmdb.create_machine(tx)
        bmdb.create_machine(tx, machine)

    with pytest.raises(sa.exc.IntegrityError):
        db.read(twice)


def test_a_revision_the_migrations_do_not_have_is_refused_before_connecting() -> None:
    bmdb.check_revision("head")
    bmdb.check_revision("+1")  # relative: only the database's revision can tell
    with pytest.raises(bmdb.UnknownRevision, match="one of: head, base, "):
        bmdb.check_revision("nonesuch")


def test_a_relative_revision_the_database_cannot_reach_is_unknown(tmp_path: Path) -> None:
    db = bmdb.connect(f"sqlite:///{tmp_path / 'b.sqlite'}", migrate=True)
    try:
        with pytest.raises(bmdb.UnknownRevision, match=r"cannot migrate to '\+5'"):
            db.migrate("+5")
    finally:
        db.close()


def test_urls_are_read_as_the_database_will_read_them() -> None:
    url = bmdb.parse_url("postgresql+psycopg2://us%40er:p%2Fw@host/db")
    assert (url.drivername, url.username, url.password, url.database) == (
        "postgresql+psycopg2", "us@er", "p/w", "db")
    bmdb.load_driver(url)
    with pytest.raises(bmdb.BadURL):
        bmdb.parse_url("not a url")
    with pytest.raises(bmdb.UnknownDialect, match="no database dialect 'nosuch'"):
        bmdb.load_driver(bmdb.parse_url("nosuch://h/db"))
    with pytest.raises(bmdb.DriverMissing, match="is not installed"):
        bmdb.load_driver(bmdb.parse_url("postgresql+pg8000://h/db"))
