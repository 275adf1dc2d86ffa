"""Connecting to the BMDB and running transactions against it.

Every change goes through ``run_transaction``: it retries transient database
errors (serialization failures, deadlocks, dropped connections, a busy SQLite
file) with tenacity, and gives the transaction body a ``Tx`` carrying the
database's clock, read once at the start so that one transaction sees one "now".
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import logging
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
import tenacity
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from bmdb._types import AnyResult, db_now, natural_key_text, sqlite_utcnow
from bmdb.errors import BMDBError, CommitOutcomeUnknown, Unavailable
from bmdb.urls import engine_url

log = logging.getLogger(__name__)
T = TypeVar("T")

#: SQLSTATEs after which running the whole transaction again is the cure.
_RETRYABLE_SQLSTATES = {"40001", "40P01", "55P03", "57P01", "57P02", "57P03"}
#: SQLSTATEs of a schema that is not (yet) migrated: undefined table, undefined column.
_UNMIGRATED_SQLSTATES = {"42P01", "42703"}


@dataclass
class Tx:
    """One open transaction: the connection, the database's clock, and the session (if any)."""

    conn: Connection
    now: dt.datetime
    session_id: uuid.UUID | None = None

    def execute(self, statement: Any, params: Any = None) -> AnyResult:
        return self.conn.execute(statement, params)

    @property
    def dialect(self) -> str:
        return self.conn.dialect.name


def is_transient(error: BaseException) -> bool:
    """True for errors after which the same transaction may simply run again."""
    if isinstance(error, BMDBError):  # said on purpose (a lost COMMIT is never retried)
        return False
    if isinstance(error, DBAPIError):
        if error.connection_invalidated:
            return True
        sqlstate = getattr(error.orig, "pgcode", None)
        if sqlstate in _RETRYABLE_SQLSTATES or (sqlstate or "").startswith("08"):
            return True
        if isinstance(error, OperationalError):
            message = str(error.orig).lower()
            return any(
                marker in message
                for marker in (
                    "database is locked",
                    "server closed the connection",
                    "connection refused",
                    "could not connect",
                    "terminating connection",
                    "connection already closed",
                    "the database system is",
                    "ssl connection has been closed",
                    "no connection to the server",
                )
            )
    return False


@contextlib.contextmanager
def available() -> Iterator[None]:
    """Raise ``Unavailable`` for SQLAlchemy's errors that mean the BMDB cannot be used now,
    so no caller outside this package needs SQLAlchemy's exceptions. The rest (a
    constraint the database enforced, a statement it refused) pass unchanged: they are
    answers, or bugs, not an outage."""
    try:
        yield
    except BMDBError:
        raise
    except (OperationalError, InterfaceError, sa.exc.TimeoutError) as error:
        raise Unavailable(_first_line(error)) from error
    except DBAPIError as error:
        if error.connection_invalidated or _sqlstate(error) in _UNMIGRATED_SQLSTATES:
            raise Unavailable(_first_line(error)) from error
        raise


def _sqlstate(error: DBAPIError) -> str | None:
    return getattr(error.orig, "pgcode", None)


def _first_line(error: sa.exc.SQLAlchemyError) -> str:
    text = str(getattr(error, "orig", None) or error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def create_engine(url: str, pool_size: int = 5) -> Engine:
    """An engine configured for the BMDB's transaction discipline on either backend.

    ``pool_size``: PostgreSQL connections kept open (10 more may be opened at peaks);
    the caller's settings decide it, this package reads no environment.
    """
    parsed = engine_url(url)
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(url)
    return sa.create_engine(
        parsed,
        isolation_level="READ COMMITTED",  # the claim's re-check relies on it: see work.py
        # No pre-ping: it costs a round trip per transaction, and a dead pooled
        # connection already surfaces as a transient error that run_transaction retries.
        pool_size=pool_size,
        max_overflow=10,
        # An UPDATE run with many parameter sets (a batch of heartbeats:
        # ``tags.record_heartbeats``) goes as one round trip (psycopg2's execute_batch),
        # not one per row. Nothing reads the rowcount of such an UPDATE.
        executemany_mode="values_plus_batch",
        executemany_batch_page_size=1000,
        connect_args={"connect_timeout": 5, "application_name": "shepherd"},
    )


def _sqlite_engine(url: str) -> Engine:
    database = sa.make_url(url).database
    if database and database != ":memory:":
        Path(database).parent.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, record: Any) -> None:
        # Let SQLAlchemy's "begin" event issue BEGIN IMMEDIATE itself: writers take
        # the file lock at the start, so a transaction never has to upgrade a read
        # lock mid-way (which deadlocks) and claims are serialised.
        dbapi_connection.isolation_level = None
        dbapi_connection.execute("PRAGMA journal_mode=WAL")
        dbapi_connection.execute("PRAGMA foreign_keys=ON")
        dbapi_connection.execute("PRAGMA busy_timeout=30000")
        dbapi_connection.create_function("shepherd_utcnow", 0, sqlite_utcnow)
        dbapi_connection.create_function("shepherd_natural_key", 1, natural_key_text,
                                         deterministic=True)

    @sa.event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def run_transaction(
    engine: Engine,
    body: Callable[[Tx], T],
    *,
    start: Callable[[Connection], Tx] | None = None,
    give_up_after: float = 30.0,
    connection: Connection | None = None,
) -> T:
    """Run ``body`` in one transaction, again from the start on transient errors.

    ``start`` opens the ``Tx`` (the session's liveness check goes there); the
    default only reads the database's clock. ``body`` may run more than once, so
    it must not have effects outside the transaction.

    ``connection``: run on this connection instead of a pooled one, for a body that
    needs what lives only there (temporary tables: ``bmdb.listing``). A transient
    error is retried on it only while it stays usable: once it is lost, so is what
    lived on it, and the error propagates.
    """
    opener = start or _plain_start
    retryable = is_transient if connection is None else functools.partial(
        _transient_on, connection)
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(retryable),
        wait=tenacity.wait_exponential_jitter(multiplier=0.02, max=2.0, jitter=0.05),
        stop=tenacity.stop_after_delay(give_up_after),
        before_sleep=_log_retry,
        reraise=True,
    )
    with available():
        result: T = retrying(_attempt, engine, body, opener, connection)
    return result


def _transient_on(connection: Connection, error: BaseException) -> bool:
    lost = connection.invalidated or getattr(error, "connection_invalidated", False)
    return is_transient(error) and not lost


def _attempt(engine: Engine, body: Callable[[Tx], T], opener: Callable[[Connection], Tx],
             connection: Connection | None = None) -> T:
    scope = engine.connect() if connection is None else contextlib.nullcontext(connection)
    with scope as conn:
        transaction = conn.begin()
        try:
            result = body(opener(conn))
        except BaseException:
            transaction.rollback()
            raise
        try:
            transaction.commit()
        except DBAPIError as error:
            # SQLite is a local file: a failed COMMIT there did not happen.
            remote = engine.dialect.name != "sqlite"
            if remote and (error.connection_invalidated or isinstance(error, OperationalError)):
                sqlstate = getattr(error.orig, "pgcode", None)
                if sqlstate not in _RETRYABLE_SQLSTATES:
                    raise CommitOutcomeUnknown(str(error.orig)) from error
            raise
        return result


def _plain_start(conn: Connection) -> Tx:
    return Tx(conn=conn, now=read_clock(conn))


def ping(engine: Engine) -> None:
    """One round trip to the database (its clock); ``Unavailable`` when it does not answer."""
    with available(), engine.connect() as conn:
        read_clock(conn)


def read_clock(conn: Connection) -> dt.datetime:
    return conn.execute(sa.select(db_now())).scalar_one()


def _log_retry(state: tenacity.RetryCallState) -> None:
    error = state.outcome.exception() if state.outcome else None
    log.warning("BMDB transaction retry %d after: %s", state.attempt_number, error)
