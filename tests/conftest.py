"""Fixtures every suite shares: real PostgreSQL and Redis servers, and a fresh BMDB per test."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

import bmdb
from tests.support.servers import MissingServer, PostgresServer, RedisServer

TEMPLATE = "shepherd_template"


def pytest_configure(config: pytest.Config) -> None:
    """No test (nor any process it starts) reads a developer's running ``shepherd up``:
    settings are read beneath ``$SHEPHERD_STATE_DIR/shepherd.env`` (``./var`` by
    default), so point that at a directory that does not exist. A test of the state
    file itself sets its own."""
    os.environ.setdefault("SHEPHERD_STATE_DIR", "/nonexistent/shepherd-tests-state")


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer | None]:
    """The throw-away PostgreSQL server, or None when SHEPHERD_TEST_PG_URL names one."""
    if os.environ.get("SHEPHERD_TEST_PG_URL"):
        yield None
        return
    try:
        server = PostgresServer().start()
    except MissingServer as error:
        pytest.exit(str(error), returncode=3)
    yield server
    server.destroy()


@pytest.fixture(scope="session")
def pg_admin_url(pg_server: PostgresServer | None) -> str:
    if url := os.environ.get("SHEPHERD_TEST_PG_URL"):
        return url
    assert pg_server is not None  # started by pg_server when the variable is unset
    return pg_server.url


@pytest.fixture(scope="session")
def pg_template(pg_admin_url: str) -> str:
    """A migrated database that each test's database is copied from (fast and isolated)."""
    admin = sa.create_engine(pg_admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {TEMPLATE} WITH (FORCE)")
        conn.exec_driver_sql(f"CREATE DATABASE {TEMPLATE}")
    db = bmdb.connect(_with_database(pg_admin_url, TEMPLATE), migrate=True)
    db.close()
    admin.dispose()
    return TEMPLATE


def _with_database(url: str, name: str) -> str:
    return sa.make_url(url).set(database=name).render_as_string(hide_password=False)


@pytest.fixture
def pg_url(pg_admin_url: str, pg_template: str) -> Iterator[str]:
    """A fresh, migrated PostgreSQL database for one test."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    admin = sa.create_engine(pg_admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE {name} TEMPLATE {pg_template}")
    yield _with_database(pg_admin_url, name)
    with admin.connect() as conn:
        conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    admin.dispose()


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    url = f"sqlite:///{tmp_path / 'bmdb.sqlite'}"
    bmdb.connect(url, migrate=True).close()
    return url


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request: pytest.FixtureRequest) -> str:
    """A fresh, migrated BMDB; every test that takes it runs on both backends."""
    return request.getfixturevalue("pg_url" if request.param == "postgresql" else "sqlite_url")


@pytest.fixture
def db(db_url: str) -> Iterator[bmdb.BMDB]:
    handle = bmdb.connect(db_url, thresholds=bmdb.Thresholds(first_heartbeat=60, heartbeat=30))
    yield handle
    handle.close()


@pytest.fixture
def session(db: bmdb.BMDB) -> Iterator[bmdb.Session]:
    with db.start_session("test", interval=2) as handle:
        yield handle


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer | None]:
    if os.environ.get("SHEPHERD_TEST_REDIS_URL"):
        yield None
        return
    try:
        server = RedisServer().start()
    except MissingServer as error:
        pytest.exit(str(error), returncode=3)
    yield server
    server.destroy()


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer | None) -> str:
    if url := os.environ.get("SHEPHERD_TEST_REDIS_URL"):
        return url
    assert redis_server is not None  # started by redis_server when the variable is unset
    return redis_server.url


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The fault scenarios' recovery times and invariant summaries, as a short table."""
    faults = sys.modules.get("tests.support.fault_fixtures")  # only if a fault test was collected
    if faults is None or not faults.RECOVERIES:
        return
    terminalreporter.write_sep("=", "fault scenarios: recovery after the fault ended")
    faults.fault_summary(terminalreporter.write_line)
