"""A provider's listing compared with its Provided tags inside the database.

Why in SQL: at a million machines, holding both sides in Python cost the updater
16 s and 540 MB (objects per row). Here the listing streams into a temporary table,
one join finds what differs, and Python never holds more than a chunk.
``shepherd.workflows.updater`` drives it::

    with bmdb.listing.open_listing(session, provider) as listing:  # revision, watermark
        listing.load(rows)       # (provider_id, reservation_id, address, location, status)
        seen = listing.unchanged()               # both sides as at the last agreeing pass?
        if seen is None:
            seen = listing.compare()
            done = listing.apply(batch_size)
            listing.remember(seen, done)

**Nothing changed reads almost nothing.** Comparing a million machines costs seconds
of PostgreSQL (loading them, one hash join); telling that neither side changed costs
a digest of the listing and a few rows. The invariant, kept by ``remember`` and
relied on by ``unchanged``: *a ``listing_digests`` row (digest D, revision R) means
that the provider's Provided tags, as they were at revision R, agreed with any
listing of digest D: a pass over such a listing has nothing to write.* ``remember``
records it only when it can prove it: every difference the comparison found was
written, and the provider's revision (``provided_revisions``: it grows with every
committed change of a tag's view, whoever writes) grew by exactly those writes since
it was read before the watermark, so nobody else changed a tag meanwhile and no tag
was left to the next run. ``unchanged`` then skips the comparison only when the
listing's digest is D and the revision read at the start is still R. A crash at any
point leaves the row as it was (it is written in one transaction, after the writes
it covers); writes since then moved the revision, so it no longer matches.

How, and why so:

* **The digest** is BLAKE2b over the listing in the CSV text COPY reads (one text
  per listing, and one listing per text), in the provider's order: a listing
  reordered compares in full once.
* **Reading first**: the provider's revision and its last agreeing pass, in a
  transaction of their own, *then* the watermark, so a tag written at or after the
  watermark moved the revision after it was read.
* **The watermark**: the database's clock is read *before* the provider is listed.
  A tag written at or after it (a machine registered by reconcile meanwhile) is
  neither judged changed nor Missing: the listing may predate it.
* **Loading**: with psycopg2, the listing's CSV goes to a temporary file as it comes
  (Python holds one chunk) and is COPied only if the comparison needs it; otherwise
  (SQLite) the rows go in a chunk per transaction with executemany. No transaction
  is open while the provider lists.
* **One connection for the comparison**: temporary tables live on one connection
  only, opened when first needed. Each load, comparison and batch runs in a short
  transaction of its own on it, so no row lock outlives a batch (Provided rows are
  also written by ``tags.set_agent_started``, which must not wait behind us). A
  transient error is retried on that connection; if the connection itself is lost,
  the run fails and the next one starts over.
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
import hashlib
import itertools
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, TypeVar

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from bmdb import _schema as schema
from bmdb import tags
from bmdb._database import Tx
from bmdb._types import AnyCompound, AnySelect
from bmdb.provided_revisions import revision
from bmdb.sessions import Session
from bmdb.tags import PROVIDER_VIEW
from bmdb.vocabulary import ProviderStatus

__all__ = ["CHUNK_ROWS", "Applied", "Comparison", "ListedView", "Listing", "open_listing"]

T = TypeVar("T")

#: One listed machine: (provider_id, reservation_id, address, location, status).
ListedView = tuple[str, str | None, str | None, str | None, str]

#: Listed machines pulled from the provider at once: what Python holds of the listing.
#: Small on purpose: the rows of a larger chunk live long enough to reach the cyclic
#: GC's oldest generation, and at a million rows the full collections that follow
#: (over whatever else the process holds, e.g. a provider's listing) cost more than
#: the work itself (1.4 s instead of 0.5 s of Python against a held listing of 1M).
CHUNK_ROWS = 1_000
#: Bytes of the spooled listing per read of PostgreSQL's COPY.
_COPY_READ = 1 << 20
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


@dataclass(frozen=True)
class Agreement:
    """The provider's last pass that left its tags agreeing with its listing (a
    ``listing_digests`` row; the invariant is the module docstring's)."""

    digest: str
    revision: int
    stored: int
    gone: int
    unregistered: int


@contextlib.contextmanager
def open_listing(session: Session, provider: str) -> Iterator[Listing]:
    """Read the provider's revision and last agreement, then the watermark (in that
    order: module docstring); the spool and connection opened later close at the end.

    The connection leaves the pool (``detach``) and is closed at the end: its
    temporary tables and settings go with it, and no later user of the pool
    inherits them.
    """
    revision_then, agreed = session.transact(functools.partial(_read_agreement,
                                                               provider=provider))
    since = session.transact(lambda tx: tx.now)
    with contextlib.ExitStack() as resources:
        yield Listing(session, provider, since, revision_then, agreed, resources)


class Listing:
    """One provider's listing (see the module docstring)."""

    def __init__(self, session: Session, provider: str, since: dt.datetime,
                 revision_then: int, agreed: Agreement | None,
                 resources: contextlib.ExitStack) -> None:
        self.session = session
        self.provider = provider
        #: The watermark: tags written at or after it are left to the next run.
        self.since = since
        #: The provider's revision, read before the watermark.
        self.revision = revision_then
        self.agreed = agreed
        #: The loaded listing's digest (``load``).
        self.digest: str | None = None
        self._resources = resources
        self._connection: Connection | None = None
        self._spool: IO[bytes] | None = None

    def load(self, rows: Iterable[ListedView]) -> int:
        """Take ``rows`` a chunk at a time and digest them; return how many. With
        psycopg2 they go to a temporary file (COPY's text: the digest's own) for
        ``compare`` to load if it must; otherwise into the table a chunk per
        transaction. The rows are pulled between transactions, so a slow provider
        holds nothing open."""
        digest = hashlib.blake2b(digest_size=20)
        spool = self._open_spool() if self._copies() else None
        iterator, loaded = iter(rows), 0
        while chunk := list(itertools.islice(iterator, CHUNK_ROWS)):
            text = copy_text(chunk).encode()
            digest.update(text)
            if spool is not None:
                spool.write(text)
            else:
                self._transact(functools.partial(_insert, rows=chunk))
            loaded += len(chunk)
        self.digest = digest.hexdigest()
        return loaded

    def unchanged(self) -> Comparison | None:
        """The last agreeing pass's counts if neither side changed since (the listing's
        digest and the revision read at the start are that pass's), else None: then
        there is nothing to write, and nothing to compare."""
        agreed = self.agreed
        if agreed is None or (agreed.digest, agreed.revision) != (self.digest, self.revision):
            return None
        return Comparison(stored=agreed.stored, changed=0, gone=agreed.gone, to_mark=0,
                          unregistered=agreed.unregistered)

    def compare(self) -> Comparison:
        """Store what differs from the loaded listing; count it."""
        if self._spool is not None:
            self._transact(functools.partial(_copy_spool, spool=self._spool))
            self._spool.close()
            self._spool = None
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

    def remember(self, seen: Comparison, done: Applied) -> bool:
        """Record this pass as the provider's agreement if it provably is one (module
        docstring): every difference written, and the revision grown by exactly those
        writes. Returns whether it was recorded."""
        written = done.updated + done.marked_missing
        if self.digest is None or written != seen.changed + seen.to_mark:
            return False
        return self.session.transact(functools.partial(
            _record_agreement, listing=self, written=written, seen=seen))

    def _copies(self) -> bool:
        return self.session.db.engine.dialect.driver == "psycopg2"

    def _open_spool(self) -> IO[bytes]:
        # Closed by the resources' exit (or by ``compare`` once loaded).
        spool = tempfile.TemporaryFile(prefix="shepherd-listing-")  # noqa: SIM115
        self._spool = self._resources.enter_context(spool)
        return spool

    def _transact(self, body: Callable[[Tx], T]) -> T:
        return self.session.transact(body, connection=self._pinned())

    def _pinned(self) -> Connection:
        """The connection of the temporary tables, opened and set up when first used."""
        if self._connection is None:
            connection = self._resources.enter_context(self.session.db.engine.connect())
            connection.detach()
            self.session.transact(_create_tables, connection=connection)
            self._connection = connection
        return self._connection


# -- what the last agreeing pass saw --------------------------------------------------------


def _read_agreement(tx: Tx, provider: str) -> tuple[int, Agreement | None]:
    d = schema.listing_digests
    row = tx.execute(sa.select(d.c.digest, d.c.revision, d.c.stored, d.c.gone,
                               d.c.unregistered).where(d.c.provider == provider)).first()
    return revision(tx, provider), Agreement(*row) if row else None


def _record_agreement(tx: Tx, listing: Listing, written: int, seen: Comparison) -> bool:
    now = revision(tx, listing.provider)
    if now - listing.revision != written:
        return False
    values = {"digest": listing.digest, "revision": now, "stored": seen.stored,
              "gone": seen.gone, "unregistered": seen.unregistered, "recorded_at": tx.now}
    tags.upsert(tx, schema.listing_digests, {"provider": listing.provider}, values)
    return True


# -- the tables ---------------------------------------------------------------------------


def _create_tables(tx: Tx) -> None:
    if tx.dialect == "postgresql":
        for name, value in POSTGRESQL_SETTINGS.items():
            tx.conn.exec_driver_sql(f"SET {name} = '{value}'")
    _metadata.create_all(tx.conn)


# -- loading ------------------------------------------------------------------------------


def _insert(tx: Tx, rows: list[ListedView]) -> None:
    """One INSERT run for all the rows (SQLite, a PostgreSQL driver without COPY)."""
    marker = "?" if tx.dialect == "sqlite" else "%s"
    tx.conn.exec_driver_sql(f"INSERT INTO {listed.name} ({', '.join(listed.c.keys())}) "
                            f"VALUES ({', '.join([marker] * len(listed.c))})", rows)


def _copy_spool(tx: Tx, spool: IO[bytes]) -> None:
    """COPY the spooled listing through the driver's own cursor (psycopg2), its errors
    raised as SQLAlchemy's (as every other statement's are), so callers and retries
    see the usual classes. From the file's start: a retry reads it again."""
    # The DBAPI connection itself: ``driver_connection`` is None once detached.
    dbapi = tx.conn.connection.dbapi_connection
    if dbapi is None:
        raise RuntimeError("the listing's connection was closed mid-load")
    driver_error = tx.conn.dialect.loaded_dbapi.Error
    spool.seek(0)
    with contextlib.closing(dbapi.cursor()) as cursor:
        try:
            cursor.copy_expert(_COPY, spool, size=_COPY_READ)
        except driver_error as error:
            raise sa.exc.DBAPIError.instance(_COPY, None, error, driver_error) from error


#: CSV with tabs: a NULL is an unquoted empty field, an empty string a quoted one,
#: and backslashes are plain characters.
_COPY = (f"COPY {listed.name} ({', '.join(listed.c.keys())}) FROM STDIN "
         "WITH (FORMAT csv, DELIMITER E'\\t')")


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
