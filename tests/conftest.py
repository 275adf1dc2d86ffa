"""Fixtures every suite shares: real PostgreSQL and Redis servers, and a fresh BMDB per test.

Under pytest-xdist each worker starts its own servers (session fixtures are per
worker); on servers named by ``SHEPHERD_TEST_PG_URL`` / ``SHEPHERD_TEST_REDIS_URL``,
which the workers share, each uses its own template database and Redis databases.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

import bmdb
from tests.support import workers
from tests.support.servers import MissingServer, PostgresServer, RedisServer, redis_db_url

#: The fixtures of tests/support, registered once for every test: a test module imports
#: only the helpers it calls.
pytest_plugins = [
    "tests.support.agent_fixtures",
    "tests.support.api_fixtures",
    "tests.support.bmc_fixtures",
    "tests.support.celery_fixtures",
    "tests.support.chromium",
    "tests.support.fault_fixtures",
    "tests.support.simulator_fixtures",
]

TEMPLATE = f"shepherd_template_{workers.NAME}"


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


@pytest.fixture(scope="session")
def pg_copy(pg_admin_url: str, pg_template: str) -> str:
    """``CREATE DATABASE``'s clause that copies the template: by files where the server
    can (PostgreSQL 15 and later; about three times faster than its default, which
    writes the whole copy to the WAL: a third of a second less for each test)."""
    admin = sa.create_engine(pg_admin_url)
    with admin.connect() as conn:
        version = int(conn.exec_driver_sql("SHOW server_version_num").scalar_one())
    admin.dispose()
    return f"TEMPLATE {pg_template}" + (" STRATEGY FILE_COPY" if version >= 150000 else "")


def _with_database(url: str, name: str) -> str:
    return sa.make_url(url).set(database=name).render_as_string(hide_password=False)


@pytest.fixture
def pg_url(pg_admin_url: str, pg_copy: str) -> Iterator[str]:
    """A fresh, migrated PostgreSQL database for one test."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    admin = sa.create_engine(pg_admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE {name} {pg_copy}")
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
    """The test's own BMDB session. Its lease is long enough to outlast a keep-alive
    thread starved by four workers on two cores; tests of expiry make their own."""
    with db.start_session("test", interval=10) as handle:
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
        return redis_db_url(url, workers.redis_database())
    assert redis_server is not None  # started by redis_server when the variable is unset
    return redis_server.url
