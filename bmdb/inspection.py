"""What operators read: machines by filter (with their tags, work, backoffs and holds),
one machine's work and backoffs, sessions.

For people (the CLI and the web view, through ``shepherd.operator``), not hot paths:
these statements are composed per call and some count whole tables. Every record is
a plain frozen dataclass, so callers never see a table or a row. Times are the
BMDB's clock (``tx.now``), the same clock the backlog queries and backoffs use.
"""

from __future__ import annotations

import datetime as dt
import functools
import uuid
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from bmdb import backlog, schema
from bmdb.database import Tx
from bmdb.processes import Process
from bmdb.queries import TAG_TABLES

#: Filter value meaning "any process" for ``MachineFilter.work`` / ``.backoff``.
ANY = "any"


@dataclass(frozen=True)
class MachineFilter:
    """Which machines to list. ``tags`` / ``without``: tag names (``TAG_TABLES``);
    ``work`` / ``backoff``: a process name, ``ANY``, or None (no filter)."""

    tags: tuple[str, ...] = ()
    without: tuple[str, ...] = ()
    provider: str | None = None
    work: str | None = None
    backoff: str | None = None
    limit: int = 500


@dataclass(frozen=True)
class MachineSummary:
    id: uuid.UUID
    created_at: dt.datetime
    provider: str | None
    provider_id: str | None
    provider_status: str | None
    address: str | None
    tags: list[str]
    work: list[str]
    backoffs: list[str]
    #: Hold kinds (``maintenance``, ``quarantine``): such a machine is in no backlog.
    holds: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class MachineList:
    now: dt.datetime
    machines: list[MachineSummary]
    matched: int
    tag_counts: dict[str, int]
    total: int


@dataclass(frozen=True)
class SessionInfo:
    id: uuid.UUID
    component: str
    holder: str
    started_at: dt.datetime
    deadline: dt.datetime
    alive: bool
    work: int = 0


@dataclass(frozen=True)
class WorkInfo:
    id: uuid.UUID
    process: str
    exclusion_group: str
    started_at: dt.datetime
    dispatch_deadline: dt.datetime | None
    session_id: uuid.UUID
    #: None when the session row is gone (the sweep deleted it).
    session: SessionInfo | None

    @property
    def session_alive(self) -> bool:
        return self.session is not None and self.session.alive


@dataclass(frozen=True)
class BackoffInfo:
    process: str
    until: dt.datetime
    interval_s: int
    cause: str
    updated_at: dt.datetime
    #: Whether it still keeps the machine out (``until`` is in the future).
    active: bool


# -- machines --------------------------------------------------------------------------


def machine_created_at(tx: Tx, machine_id: uuid.UUID) -> dt.datetime | None:
    """The machine's creation time, or None when the BMDB has no such machine."""
    m = schema.machines
    return tx.execute(sa.select(m.c.created_at).where(m.c.id == machine_id)
                      ).scalar_one_or_none()


def tag_counts(tx: Tx) -> dict[str, int]:
    """Machines carrying each tag, in ``TAG_TABLES`` order (whole-table counts)."""
    return {name: tx.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()
            for name, table in TAG_TABLES.items()}


def _filtered(tx: Tx, f: MachineFilter) -> sa.Select:
    m, p = schema.machines, schema.provided
    query = sa.select(m.c.id, m.c.created_at, p.c.provider, p.c.provider_id,
                      p.c.provider_status, p.c.address
                      ).select_from(m.outerjoin(p, p.c.machine_id == m.c.id))
    # Aliases: ``provided`` is in the outer FROM too, and would be auto-correlated away.
    for tag in f.tags:
        table = TAG_TABLES[tag].alias()
        query = query.where(sa.exists().where(table.c.machine_id == m.c.id))
    for tag in f.without:
        table = TAG_TABLES[tag].alias()
        query = query.where(~sa.exists().where(table.c.machine_id == m.c.id))
    if f.provider:
        query = query.where(p.c.provider == f.provider)
    if f.work:
        w = schema.work
        held = sa.exists().where(w.c.machine_id == m.c.id)
        if f.work != ANY:
            held = held.where(w.c.process == f.work)
        query = query.where(held)
    if f.backoff:
        b = schema.backoff
        waiting = sa.exists().where(b.c.machine_id == m.c.id, b.c.until > tx.now)
        if f.backoff != ANY:
            waiting = waiting.where(b.c.process == f.backoff)
        query = query.where(waiting)
    return query


def list_machines(tx: Tx, f: MachineFilter = MachineFilter()) -> MachineList:
    """Machines matching ``f`` (oldest first, at most ``f.limit``), with their tags,
    work and active backoffs, plus per-tag counts over the whole fleet."""
    query = _filtered(tx, f)
    matched = tx.execute(sa.select(sa.func.count()).select_from(query.subquery())).scalar_one()
    m = schema.machines
    rows = tx.execute(query.order_by(m.c.created_at, m.c.id).limit(f.limit)).all()
    ids = [row.id for row in rows]
    tags: dict[uuid.UUID, list[str]] = {i: [] for i in ids}
    work: dict[uuid.UUID, list[str]] = {i: [] for i in ids}
    backoffs: dict[uuid.UUID, list[str]] = {i: [] for i in ids}
    holds: dict[uuid.UUID, list[str]] = {i: [] for i in ids}
    if ids:
        for name, table in TAG_TABLES.items():
            for machine_id in tx.execute(sa.select(table.c.machine_id)
                                         .where(table.c.machine_id.in_(ids))).scalars():
                tags[machine_id].append(name)
        w, b = schema.work, schema.backoff
        for row in tx.execute(sa.select(w.c.machine_id, w.c.process)
                              .where(w.c.machine_id.in_(ids)).order_by(w.c.process)):
            work[row.machine_id].append(row.process)
        for row in tx.execute(sa.select(b.c.machine_id, b.c.process)
                              .where(b.c.machine_id.in_(ids), b.c.until > tx.now)
                              .order_by(b.c.process)):
            backoffs[row.machine_id].append(row.process)
        # The holds' primary key (machine_id, kind) serves this lookup.
        h = schema.machine_holds
        for row in tx.execute(sa.select(h.c.machine_id, h.c.kind)
                              .where(h.c.machine_id.in_(ids)).order_by(h.c.kind)):
            holds[row.machine_id].append(row.kind)
    machines = [
        MachineSummary(id=row.id, created_at=row.created_at, provider=row.provider,
                       provider_id=row.provider_id, provider_status=row.provider_status,
                       address=row.address, tags=tags[row.id], work=work[row.id],
                       backoffs=backoffs[row.id], holds=holds[row.id])
        for row in rows
    ]
    total = tx.execute(sa.select(sa.func.count()).select_from(schema.machines)).scalar_one()
    return MachineList(now=tx.now, machines=machines, matched=matched,
                       tag_counts=tag_counts(tx), total=total)


def in_backlog(tx: Tx, process: Process, machine_id: uuid.UUID,
               thresholds: backlog.Thresholds) -> bool:
    """Whether the process's own backlog query selects the machine (work and backoff
    aside): the same query claims run."""
    candidates = backlog.retriever(process, thresholds)(tx).subquery()
    query = sa.select(candidates.c[0]).where(candidates.c[0] == machine_id).limit(1)
    return tx.execute(query).first() is not None


# -- work and backoffs ----------------------------------------------------------------


def _session_info(row: Any, now: dt.datetime) -> SessionInfo | None:
    if row.s_id is None:
        return None
    return SessionInfo(id=row.s_id, component=row.component, holder=row.holder,
                       started_at=row.s_started_at, deadline=row.deadline,
                       alive=row.deadline > now)


def machine_work(tx: Tx, machine_id: uuid.UUID, group: str | None = None) -> list[WorkInfo]:
    """The work holding the machine (in exclusion ``group`` only, when given), oldest
    first, each with its session as it is now."""
    w, s = schema.work, schema.sessions
    query = (
        sa.select(w, s.c.id.label("s_id"), s.c.component, s.c.holder,
                  s.c.started_at.label("s_started_at"), s.c.deadline)
        .select_from(w.outerjoin(s, s.c.id == w.c.session_id))
        .where(w.c.machine_id == machine_id)
        .order_by(w.c.started_at)
    )
    if group is not None:
        query = query.where(w.c.exclusion_group == group)
    return [
        WorkInfo(id=row.id, process=row.process, exclusion_group=row.exclusion_group,
                 started_at=row.started_at, dispatch_deadline=row.dispatch_deadline,
                 session_id=row.session_id, session=_session_info(row, tx.now))
        for row in tx.execute(query)
    ]


def machine_backoffs(tx: Tx, machine_id: uuid.UUID, process: Process | str | None = None
                     ) -> list[BackoffInfo]:
    """Every backoff of the machine (of ``process`` only, when given), expired ones too."""
    b = schema.backoff
    query = sa.select(b).where(b.c.machine_id == machine_id).order_by(b.c.process)
    if process is not None:
        query = query.where(b.c.process == Process(process).value)
    return [
        BackoffInfo(process=row.process, until=row.until, interval_s=row.interval_s,
                    cause=row.cause, updated_at=row.updated_at, active=row.until > tx.now)
        for row in tx.execute(query)
    ]


# -- sessions --------------------------------------------------------------------------


def list_sessions(tx: Tx, include_dead: bool = True) -> list[SessionInfo]:
    """Every session (dead ones stay until the sweep deletes them), newest first, with
    how much work each holds."""
    s, w = schema.sessions, schema.work
    held = (sa.select(sa.func.count()).where(w.c.session_id == s.c.id)
            .correlate(s).scalar_subquery())
    query = sa.select(s, held.label("work")).order_by(s.c.started_at.desc(), s.c.id)
    if not include_dead:
        query = query.where(s.c.deadline > tx.now)
    return [
        SessionInfo(id=row.id, component=row.component, holder=row.holder,
                    started_at=row.started_at, deadline=row.deadline,
                    alive=row.deadline > tx.now, work=row.work)
        for row in tx.execute(query)
    ]


# -- a machine's tags, as stored -------------------------------------------------------


@dataclass(frozen=True)
class StoredJSON:
    """A JSON column's content as stored, not decoded (``machine_tags_as_stored``)."""

    text: str


def machine_tags_as_stored(tx: Tx, machine_id: uuid.UUID) -> dict[str, dict[str, Any]]:
    """Every tag the machine has, as ``queries.machine_tags`` reads them, but with each
    JSON column (reports, installation requests) as ``StoredJSON``: its text.

    Why: the drivers decode a JSON column while fetching its row, so one stored
    document that does not decode (nested deeper than the stack allows, or text that
    is not JSON at all, which SQLite never checks) would fail the whole read, and with
    it ``shepherd show``, ``explain`` and the machine's page. Operators' code decodes
    the text itself, with bounds (``shepherd.operator.stored``). SQLite's column is
    read as bytes, decoded with replacement: a value stored there as a BLOB need not
    be UTF-8, and the driver would fail on it.
    """
    tags = {}
    for name in TAG_TABLES:
        row = tx.execute(_stored_query(tx.dialect, name), {"machine": machine_id}
                         ).one_or_none()
        if row is not None:
            tags[name] = {key: _stored(value) if key in _JSON_COLUMNS[name] else value
                          for key, value in row._mapping.items()}
    return tags


#: Tag name -> the names of its JSON columns.
_JSON_COLUMNS = {name: frozenset(c.name for c in table.c if isinstance(c.type, sa.JSON))
                 for name, table in TAG_TABLES.items()}


@functools.cache
def _stored_query(dialect: str, name: str) -> sa.Select:
    """The tag's row without ``machine_id``, JSON columns cast to text (bytes on
    SQLite), so that no driver decodes them. Built once per dialect and tag."""
    table = TAG_TABLES[name]
    raw = sa.LargeBinary if dialect == "sqlite" else sa.Text
    columns = [sa.cast(c, raw).label(c.name) if c.name in _JSON_COLUMNS[name] else c
               for c in table.c if c.name != "machine_id"]
    return sa.select(*columns).where(table.c.machine_id == sa.bindparam("machine"))


def _stored(value: str | bytes | None) -> StoredJSON | None:
    if value is None:  # the columns are NOT NULL; SQL NULL is no document either way
        return None
    return StoredJSON(value.decode("utf-8", "replace") if isinstance(value, bytes) else value)
