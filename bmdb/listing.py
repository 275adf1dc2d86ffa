"""A provider's listing compared with its Provided tags inside the database.

Why in SQL: at a million machines, holding both sides in Python cost the updater
16 s and 540 MB (objects per row). Here the listing streams into a temporary table a
chunk at a time, one join finds what differs, and Python never holds more than a
chunk. ``shepherd.workflows.updater`` drives it::

    with bmdb.listing.open_listing(session, provider) as listing:  # reads the watermark
        listing.load(rows)       # (provider_id, reservation_id, address, location, status)
        seen = listing.compare()
        done = listing.apply(batch_size)

How, and why so:

* **One connection for the run**: temporary tables live on one connection only. Each
  chunk loads, and each batch writes, in a short transaction of its own on it, so no
  transaction waits on the provider and no row lock outlives a batch (Provided rows
  are also written by ``tags.set_agent_started``, which must not wait behind us).
  A transient error is retried on that connection; if the connection itself is
  lost, the run fails and the next one starts over.
* **The watermark**: the database's clock is read *before* the provider is listed.
  A tag written at or after it (a machine registered by reconcile meanwhile) is
  neither judged changed nor Missing: the listing may predate it.
* **Loading**: PostgreSQL with COPY (CSV), each block of rows formatted as the server
  reads the one before; SQLite with executemany.
* **Comparing** is one statement that stores only the rows that differ (a status
  outside ``ProviderStatus`` is refused there, before any write): on PostgreSQL
  a hash FULL JOIN finds changed, gone and unregistered machines in one pass; SQLite
  (which has FULL JOIN only from 3.39) runs a LEFT JOIN and an anti-join.
* **Writing** is ``tags.refresh_provided`` and ``tags.mark_provided_missing`` a batch
  per transaction, each re-checking the row as it is then: a machine deleted
  meanwhile is skipped, a tag already equal is not written.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from bmdb import _schema as schema
from bmdb import tags
from bmdb._database import Tx
from bmdb._types import AnyCompound, AnySelect
from bmdb.sessions import Session
from bmdb.tags import PROVIDER_VIEW
from bmdb.vocabulary import ProviderStatus

__all__ = ["CHUNK_ROWS", "Applied", "Comparison", "ListedView", "Listing", "open_listing"]

T = TypeVar("T")

#: One listed machine: (provider_id, reservation_id, address, location, status).
ListedView = tuple[str, str | None, str | None, str | None, str]

#: Listed machines pulled from the provider and loaded per transaction: what Python
#: holds of the listing at once (a few MB).
CHUNK_ROWS = 10_000
#: Rows formatted per read of PostgreSQL's COPY.
_BLOCK_ROWS = 1_000
#: Settings of the run's PostgreSQL connection (set first: ``temp_buffers`` cannot
#: change once a temporary table was used). With the defaults (8 MB, 4 MB) a million
#: listed machines (~70 MB) spill to disk while loading, and the join spills again.
#: The memory is taken as used, and freed when the run's connection closes.
POSTGRESQL_SETTINGS = {"temp_buffers": "256MB", "work_mem": "256MB"}

CHANGED, GONE, UNREGISTERED = "changed", "gone", "unregistered"

_metadata = sa.MetaData()
_statuses = ", ".join(f"'{status.value}'" for status in ProviderStatus)

#: The listing as loaded (no key: a hash join needs none, and an index costs the load).
listed = sa.Table(
    "shepherd_listing", _metadata,
    sa.Column("provider_id", sa.Text, nullable=False),
    sa.Column("reservation_id", sa.Text),
    sa.Column("address", sa.Text),
    sa.Column("location", sa.Text),
    sa.Column("provider_status", sa.Text, nullable=False),
    prefixes=["TEMPORARY"],
)

#: What differs: ``changed`` (the listed view), ``gone`` (a tag not listed; to write if
#: not Missing yet), ``unregistered`` (listed, no tag: counted only). ``seq`` orders
#: the batches; one row per machine (a provider id listed twice is judged once).
changes = sa.Table(
    "shepherd_listing_changes", _metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("machine_id", sa.Uuid, unique=True),
    sa.Column("provider_id", sa.Text, nullable=False),
    sa.Column("reservation_id", sa.Text),
    sa.Column("address", sa.Text),
    sa.Column("location", sa.Text),
    sa.Column("provider_status", sa.Text),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("to_write", sa.Boolean, nullable=False),
    # Checked here, not while loading: a status that differs from none stored is new,
    # and a million checks would cost the load a tenth of a second.
    sa.CheckConstraint(f"provider_status IN ({_statuses})"),
    prefixes=["TEMPORARY"],
)


@dataclass(frozen=True)
class Comparison:
    """The listing against the provider's tags, in counts (small at any size).

    ``stored``: the provider's tags; ``changed``: tags whose listed view differs (to
    write); ``gone``: tags the listing lacks, ``to_mark`` of them not Missing yet (to
    write); ``unregistered``: provider ids listed without a tag. Tags written since
    the watermark count in ``stored`` only.
    """

    stored: int
    changed: int
    gone: int
    to_mark: int
    unregistered: int


@dataclass(frozen=True)
class Applied:
    """What the batches wrote: fewer than compared when rows changed meanwhile."""

    updated: int = 0
    marked_missing: int = 0
    batches: int = 0


@contextlib.contextmanager
def open_listing(session: Session, provider: str) -> Iterator[Listing]:
    """A connection of the run's own, its temporary tables, and the watermark.

    The connection leaves the pool (``detach``) and is closed at the end: its
    temporary tables and settings go with it, and no later user of the pool
    inherits them.
    """
    with session.db.engine.connect() as connection:
        connection.detach()
        since = session.transact(_create_tables, connection=connection)
        yield Listing(session, connection, provider, since)


class Listing:
    """One provider's listing on the run's connection (see the module docstring)."""

    def __init__(self, session: Session, connection: Connection, provider: str,
                 since: dt.datetime) -> None:
        self.session = session
        self.connection = connection
        self.provider = provider
        #: The watermark: tags written at or after it are left to the next run.
        self.since = since

    def load(self, rows: Iterable[ListedView]) -> int:
        """Load ``rows`` a chunk per transaction; return how many. The rows are pulled
        between transactions, so a slow provider holds nothing open."""
        iterator, loaded = iter(rows), 0
        while chunk := list(itertools.islice(iterator, CHUNK_ROWS)):
            self._transact(functools.partial(_load, rows=chunk))
            loaded += len(chunk)
        return loaded

    def compare(self) -> Comparison:
        """Store what differs from the loaded listing; count it."""
        return self._transact(lambda tx: _compare(tx, self.provider, self.since))

    def apply(self, batch_size: int) -> Applied:
        """Write what ``compare`` stored, ``batch_size`` machines per transaction."""
        after, applied = 0, Applied()
        while step := self._transact(functools.partial(
                _apply_batch, listing=self, after=after, batch_size=batch_size)):
            after, updated, marked = step
            applied = Applied(applied.updated + updated,
                              applied.marked_missing + marked, applied.batches + 1)
        return applied

    def _transact(self, body: Callable[[Tx], T]) -> T:
        return self.session.transact(body, connection=self.connection)


# -- the tables ---------------------------------------------------------------------------


def _create_tables(tx: Tx) -> dt.datetime:
    if tx.dialect == "postgresql":
        for name, value in POSTGRESQL_SETTINGS.items():
            tx.conn.exec_driver_sql(f"SET {name} = '{value}'")
    _metadata.create_all(tx.conn)
    return tx.now


# -- loading ------------------------------------------------------------------------------


def _load(tx: Tx, rows: list[ListedView]) -> None:
    """COPY with psycopg2 (the driver this package is installed with), else one INSERT
    run for all the rows (SQLite, another PostgreSQL driver)."""
    if tx.dialect == "postgresql":
        # The DBAPI connection itself: ``driver_connection`` is None once detached.
        dbapi = tx.conn.connection.dbapi_connection
        if dbapi is None:
            raise RuntimeError("the listing's connection was closed mid-load")
        with contextlib.closing(dbapi.cursor()) as cursor:
            if hasattr(cursor, "copy_expert"):
                _copy(tx, cursor, rows)
                return
    marker = "?" if tx.dialect == "sqlite" else "%s"
    tx.conn.exec_driver_sql(f"INSERT INTO {listed.name} ({', '.join(listed.c.keys())}) "
                            f"VALUES ({', '.join([marker] * len(listed.c))})", rows)


def _copy(tx: Tx, cursor: Any, rows: list[ListedView]) -> None:
    """COPY through the driver's own cursor, its errors raised as SQLAlchemy's (as
    every other statement's are), so callers and retries see the usual classes."""
    driver_error = tx.conn.dialect.loaded_dbapi.Error
    try:
        cursor.copy_expert(_COPY, _CopySource(rows))
    except driver_error as error:
        raise sa.exc.DBAPIError.instance(_COPY, None, error, driver_error) from error


#: CSV with tabs: a NULL is an unquoted empty field, an empty string a quoted one,
#: and backslashes are plain characters.
_COPY = (f"COPY {listed.name} ({', '.join(listed.c.keys())}) FROM STDIN "
         "WITH (FORMAT csv, DELIMITER E'\\t')")


class _CopySource:
    """The file COPY reads: each read formats the next block of rows, so the server
    stores one block while Python formats the next."""

    def __init__(self, rows: list[ListedView]) -> None:
        self._rows = rows
        self._at = 0

    def read(self, size: int = -1) -> str:
        block = self._rows[self._at:self._at + _BLOCK_ROWS]
        self._at += len(block)
        return copy_text(block)

    readline = read


#: A falsy field as COPY's CSV writes it: None is NULL, an empty string is quoted.
_FALSY = {None: "", "": '""'}


def copy_text(rows: list[ListedView]) -> str:
    """``rows`` in the CSV of ``_COPY``. The fast path (about 0.25 µs a row) joins the
    fields as they are, then checks that the text holds no character that needed
    quoting: every tab and newline must be one it put there, and no quote nor
    carriage return may appear (an empty string's quotes also send a block here)."""
    if not rows:
        return ""
    text = "\n".join([
        "\t".join((p or '""', r or _FALSY[r], a or _FALSY[a], loc or _FALSY[loc], s))
        for p, r, a, loc, s in rows]) + "\n"
    clean = (text.count("\t") == 4 * len(rows) and text.count("\n") == len(rows)
             and '"' not in text and "\r" not in text)
    return text if clean else "".join(_quoted_line(row) for row in rows)


def _quoted_line(row: ListedView) -> str:
    return "\t".join("" if field is None else _quoted(str(field)) for field in row) + "\n"


def _quoted(field: str) -> str:
    return '"' + field.replace('"', '""') + '"'


# -- comparing ----------------------------------------------------------------------------


def _compare(tx: Tx, provider: str, since: dt.datetime) -> Comparison:
    if tx.dialect == "sqlite":  # no hash join: the gone are looked up in the listing
        tx.conn.exec_driver_sql(f"CREATE INDEX ix_{listed.name} ON {listed.name} (provider_id)")
    insert = postgresql.insert if tx.dialect == "postgresql" else sqlite.insert
    columns = [c.name for c in changes.c if c.name != "seq"]
    tx.execute(insert(changes).from_select(columns, _differences(tx.dialect, provider, since))
               .on_conflict_do_nothing(index_elements=["machine_id"]))
    return _counts(tx, provider)


def _differences(dialect: str, provider: str, since: dt.datetime) -> AnySelect | AnyCompound:
    """Rows for ``changes``: every tag whose view differs or that is not listed, and
    (for counting) every provider id listed without a tag."""
    p = schema.provided
    ours = (sa.select(p.c.machine_id, p.c.provider_id, p.c.updated_at,
                      *(p.c[name] for name in PROVIDER_VIEW))
            .where(p.c.provider == provider).subquery("ours"))
    on = ours.c.provider_id == listed.c.provider_id
    if dialect == "postgresql":
        return _judged(ours, ours.join(listed, on, full=True), since)
    return sa.union_all(_judged(ours, ours.outerjoin(listed, on), since),
                        _unregistered(provider))


def _judged(ours: sa.Subquery, joined: sa.Join, since: dt.datetime) -> AnySelect:
    gone = listed.c.provider_id.is_(None)
    unregistered = ours.c.machine_id.is_(None)
    differs = sa.or_(*(listed.c[n].is_distinct_from(ours.c[n]) for n in PROVIDER_VIEW))
    not_missing = ours.c.provider_status != ProviderStatus.MISSING.value
    return (
        sa.select(ours.c.machine_id,
                  sa.func.coalesce(listed.c.provider_id, ours.c.provider_id),
                  *(listed.c[n] for n in PROVIDER_VIEW),
                  sa.case((gone, GONE), (unregistered, UNREGISTERED), else_=CHANGED),
                  sa.case((gone, not_missing), (unregistered, sa.false()), else_=sa.true()))
        .select_from(joined)
        .where(sa.or_(gone, unregistered, differs),
               sa.or_(ours.c.updated_at.is_(None), ours.c.updated_at < since))
    )


def _unregistered(provider: str) -> AnySelect:
    p = schema.provided
    known = sa.exists().where(p.c.provider == provider,
                              p.c.provider_id == listed.c.provider_id)
    return (sa.select(sa.null(), listed.c.provider_id,
                      *(listed.c[n] for n in PROVIDER_VIEW),
                      sa.literal(UNREGISTERED), sa.false())
            .where(~known))


def _counts(tx: Tx, provider: str) -> Comparison:
    writes = sa.func.sum(sa.case((changes.c.to_write, 1), else_=0))
    by_kind = {
        row.kind: row for row in tx.execute(
            sa.select(changes.c.kind, sa.func.count().label("rows"), writes.label("writes"),
                      sa.func.count(changes.c.provider_id.distinct()).label("ids"))
            .group_by(changes.c.kind))
    }
    p = schema.provided
    stored = tx.execute(sa.select(sa.func.count()).where(p.c.provider == provider)).scalar_one()

    def rows(kind: str, field: str = "rows") -> int:
        return int(getattr(by_kind[kind], field)) if kind in by_kind else 0

    return Comparison(stored=stored, changed=rows(CHANGED), gone=rows(GONE),
                      to_mark=rows(GONE, "writes"), unregistered=rows(UNREGISTERED, "ids"))


# -- writing ------------------------------------------------------------------------------


def _apply_batch(tx: Tx, listing: Listing, after: int,
                 batch_size: int) -> tuple[int, int, int] | None:
    """The next ``batch_size`` rows to write after ``after``: (last seq, updated,
    marked Missing), or None when none is left."""
    seqs = tx.execute(
        sa.select(changes.c.seq).where(changes.c.to_write, changes.c.seq > after)
        .order_by(changes.c.seq).limit(batch_size)).scalars().all()
    if not seqs:
        return None
    batch = sa.and_(changes.c.seq > after, changes.c.seq <= seqs[-1], changes.c.to_write)
    views = (sa.select(changes.c.machine_id, changes.c.provider_id,
                       *(changes.c[n] for n in PROVIDER_VIEW))
             .where(batch, changes.c.kind == CHANGED).subquery())
    machines = sa.select(changes.c.machine_id).where(batch, changes.c.kind == GONE).subquery()
    updated = tags.refresh_provided(tx, views, written_before=listing.since)
    marked = tags.mark_provided_missing(tx, machines, written_before=listing.since)
    return seqs[-1], updated, marked
