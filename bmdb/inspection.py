"""What operators read: machines by filter (with their tags, work, backoffs and holds),
one machine's work and backoffs, sessions.

For people (the CLI and the web view, through ``shepherd.operations``), not hot paths:
these statements are composed per call. None counts a whole table: pages are keyset
walks and fleet figures come from ``counters``. Every record is
a plain frozen dataclass, so callers never see a table or a row. Times are the
BMDB's clock (``tx.now``), the same clock the backlog queries and backoffs use.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import functools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import sqlalchemy as sa

from bmdb import _counters as counters
from bmdb import _schema as schema
from bmdb import backlog, fleet
from bmdb._database import Tx
from bmdb._types import AnySelect, natural_key, natural_key_text
from bmdb.fleet import HEARTBEATING, INSTALLING, SILENT
from bmdb.queries import TAG_TABLES, Glance, glance_joins, glance_of
from bmdb.vocabulary import HOLD_KINDS, Process

#: Filter value meaning "any process" for ``MachineFilter.work`` / ``.backoff``.
ANY = "any"


#: The largest page a caller may ask for: a page is read, rendered and sent whole.
MAX_PAGE = 1000
#: A page's orders: ``CREATED``, oldest first; ``NAME``, by provider (or inventory) id
#: in natural order, machines without one last (``_by_name`` says what it costs).
CREATED, NAME = "created", "name"
SORTS = (CREATED, NAME)


@dataclass(frozen=True)
class MachineFilter:
    """Which machines to list, in which order. ``tags`` / ``without``: tag names
    (``TAG_TABLES``); ``work`` / ``backoff``: a process name, ``ANY``, or None (no
    filter); ``health``: one of ``HEALTH`` (``fleet.HealthCounts`` says what each
    means); ``held``: a hold kind or ``ANY``; ``sort``: one of ``SORTS``; ``limit``:
    the page size (1 to ``MAX_PAGE``); ``after``: a ``MachineList.next_cursor`` of the
    same sort, to read the page that follows it."""

    #: What ``health`` and ``sort`` take, for callers outside ``bmdb``.
    HEALTH: ClassVar[tuple[str, ...]] = fleet.HEALTH
    SORTS: ClassVar[tuple[str, ...]] = SORTS

    tags: tuple[str, ...] = ()
    without: tuple[str, ...] = ()
    provider: str | None = None
    work: str | None = None
    backoff: str | None = None
    limit: int = 500
    after: str | None = None
    health: str | None = None
    held: str | None = None
    sort: str = CREATED

    def __post_init__(self) -> None:
        if not 1 <= self.limit <= MAX_PAGE:
            raise ValueError(f"a page holds 1 to {MAX_PAGE} machines, not {self.limit}")
        if self.health is not None and self.health not in fleet.HEALTH:
            raise ValueError(f"unknown health {self.health!r}; one of: "
                             f"{', '.join(fleet.HEALTH)}")
        if self.held is not None and self.held not in (ANY, *HOLD_KINDS):
            raise ValueError(f"unknown hold {self.held!r}; one of: {ANY}, "
                             f"{', '.join(HOLD_KINDS)}")
        if self.sort not in SORTS:
            raise ValueError(f"unknown order {self.sort!r}; one of: {', '.join(SORTS)}")
        if self.after is not None:  # refuse a malformed cursor before any query
            (decode_name_cursor if self.sort == NAME else decode_cursor)(self.after)

    @property
    def driven(self) -> bool:
        """Whether a few rows elsewhere pick the machines (work, backoffs, the silent or
        installing ones): the page starts from those, not from a walk of the machines."""
        return bool(self.work or self.backoff or self.health in (SILENT, INSTALLING))


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
    #: Machines matching the filter, on every page (not only this one).
    matched: int
    tag_counts: dict[str, int]
    total: int
    #: Pass as ``MachineFilter.after`` for the next page; None on the last page.
    next_cursor: str | None = None
    #: ``matched`` is the planner's estimate, not a count (a provider filter alone:
    #: counting it exactly would read every machine of a large provider).
    matched_estimated: bool = False
    #: Machines per hold kind over the whole fleet (``fleet.held_counts``' figures).
    held_counts: dict[str, int] = field(default_factory=dict)


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


@dataclass(frozen=True)
class MachineName:
    """A machine and the names operators know it by: its provider's id (an inventory's
    own name for it, ``rack1-u01``, or a cloud's device id). None when not Provided."""

    machine_id: uuid.UUID
    provider: str | None
    provider_id: str | None


def machines_by_provider_id(tx: Tx, provider_id: str, limit: int = 10) -> list[MachineName]:
    """Machines whose provider id is ``provider_id``, of any provider (each provider's
    are unique; two providers may share one), at most ``limit``."""
    p = schema.provided
    rows = tx.execute(sa.select(p.c.machine_id, p.c.provider, p.c.provider_id)
                      .where(p.c.provider_id == provider_id)
                      .order_by(p.c.provider, p.c.machine_id).limit(limit)).all()
    return [MachineName(*row) for row in rows]


def machines_by_id_prefix(tx: Tx, hex_prefix: str, limit: int = 10) -> list[MachineName]:
    """Machines whose id starts with ``hex_prefix`` (hex digits, no hyphens), at most
    ``limit``, in id order. A range of ids, not a text match, so the primary key's
    index finds them at any fleet size."""
    digits = hex_prefix.lower()
    if not 0 < len(digits) <= 32 or any(c not in "0123456789abcdef" for c in digits):
        raise ValueError(f"not a hex prefix of a machine id: {hex_prefix!r}")
    low = uuid.UUID(digits.ljust(32, "0"))
    high = uuid.UUID(digits.ljust(32, "f"))
    m, p = schema.machines, schema.provided
    rows = tx.execute(sa.select(m.c.id, p.c.provider, p.c.provider_id)
                      .select_from(m.outerjoin(p, p.c.machine_id == m.c.id))
                      .where(m.c.id.between(low, high))
                      .order_by(m.c.id).limit(limit)).all()
    return [MachineName(*row) for row in rows]


def _tag_counts(states: dict[int, int]) -> dict[str, int]:
    """Machines carrying each tag, in ``TAG_TABLES`` order."""
    return {name: counters.machines_with(states, _TAG_BIT[name]) for name in TAG_TABLES}


#: Tag name -> its bit in ``machines.tag_bits``.
_TAG_BIT = {name: counters.TAG_BITS[table.name] for name, table in TAG_TABLES.items()}


# -- cursors: a position in the page's order, opaque to callers -------------------------


def encode_cursor(created_at: dt.datetime, machine_id: uuid.UUID) -> str:
    """A position in ``CREATED`` order."""
    return _encoded(f"{created_at.isoformat()}|{machine_id}")


def decode_cursor(cursor: str) -> tuple[dt.datetime, uuid.UUID]:
    """The position a ``CREATED`` cursor names; ValueError for anything
    ``encode_cursor`` did not make. A position, not a row: the machine it came from
    may be gone since."""
    try:
        when, machine = _decoded(cursor).split("|")
        created_at = dt.datetime.fromisoformat(when)
        if created_at.tzinfo is None:
            raise ValueError
        return created_at, uuid.UUID(machine)
    except (ValueError, UnicodeDecodeError, binascii.Error):
        raise _not_a_cursor(cursor) from None


def encode_name_cursor(provider_id: str | None, machine_id: uuid.UUID) -> str:
    """A position in ``NAME`` order: the provider id (None: the machine has none) and
    the machine's id. The id as given, not its key: the query computes the key of
    both sides alike, on either backend."""
    return _encoded(f"name|{machine_id}|" + ("-" if provider_id is None else "=" + provider_id))


def decode_name_cursor(cursor: str) -> tuple[str | None, uuid.UUID]:
    """The position an ``encode_name_cursor`` cursor names; ValueError for any other."""
    try:
        kind, machine, name = _decoded(cursor).split("|", 2)
        if kind != "name" or not (name == "-" or name.startswith("=")):
            raise ValueError
        return (None if name == "-" else name[1:]), uuid.UUID(machine)
    except (ValueError, UnicodeDecodeError, binascii.Error):
        raise _not_a_cursor(cursor) from None


def _encoded(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def _decoded(cursor: str) -> str:
    return base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()


def _not_a_cursor(cursor: str) -> ValueError:
    return ValueError(f"{cursor[:80]!r} is not a page cursor of this order (take it from "
                      "the previous page's next link)")


# -- pages of machines ------------------------------------------------------------------


def list_machines(tx: Tx, f: MachineFilter = MachineFilter(),
                  thresholds: backlog.Thresholds | None = None) -> MachineList:
    """A page of the machines matching ``f`` (in ``f.sort`` order, ``f.limit`` at most,
    after ``f.after``), with their tags, work, active backoffs and holds, plus the
    fleet's per-tag counts. ``thresholds`` (the BMDB's: what ``heartbeating`` and
    ``silent`` are measured by) are needed for those two filters only; the fleet's
    health figures are ``fleet.health_counts``, read apart so that a page can read
    them less often than its rows (``shepherd.server.web``).

    Flat in the fleet's size in creation order: the tag and hold filters become a set
    of ``tag_bits`` values (from the counters, only those that occur), and each is a
    keyset walk on the index (tag_bits, created_at, id) that stops after one page; work,
    backoff, silent and installing filters start from those (small) sets instead.
    Tags and holds come from ``tag_bits``. By name: ``_by_name``.
    """
    return _listed(tx, f, thresholds, glances=False)[0]


def list_machines_at_a_glance(tx: Tx, f: MachineFilter = MachineFilter(),
                              thresholds: backlog.Thresholds | None = None
                              ) -> tuple[MachineList, dict[uuid.UUID, Glance]]:
    """``list_machines``, and each listed machine's ``Glance`` read by the same statement
    (primary-key probes per row of the page): one round trip, no list of ids sent back."""
    return _listed(tx, f, thresholds, glances=True)


def _listed(tx: Tx, f: MachineFilter, thresholds: backlog.Thresholds | None, glances: bool
            ) -> tuple[MachineList, dict[uuid.UUID, Glance]]:
    if f.health in (HEARTBEATING, SILENT) and thresholds is None:
        raise ValueError(f"listing the {f.health} machines needs the BMDB's thresholds")
    states = counters.states(tx)
    allowed = _allowed_states(f, states)
    # As mappings: a Row read by attribute costs 5x a key lookup, ~20 reads a row.
    rows = _rows(tx, f, allowed, thresholds, glances) if allowed else []
    page, more = rows[:f.limit], len(rows) > f.limit
    matched, estimated = _matched(tx, f, states, allowed, thresholds)
    found = MachineList(
        now=tx.now, machines=_summaries(page), matched=matched,
        tag_counts=_tag_counts(states), total=sum(states.values()),
        next_cursor=_cursor(f.sort, page[-1]) if more else None,
        matched_estimated=estimated,
        held_counts=counters.hold_counts(states))
    return found, {row["id"]: glance_of(row) for row in page} if glances else {}


def _rows(tx: Tx, f: MachineFilter, allowed: list[int], thresholds: backlog.Thresholds | None,
          glances: bool) -> list[sa.RowMapping]:
    """The page's rows, and one more if there is one. By name, the named machines
    first; only when they do not fill it, the unnamed ones (their walk is a pass over
    the fleet, so a page that does not need it does not run it)."""
    def walk(named: bool = True) -> list[sa.RowMapping]:
        page = _page(tx, f, allowed, thresholds, named)
        return list(tx.execute(_with_work_and_backoffs(tx, page, f.sort, glances)).mappings())

    if f.sort != NAME:
        return walk()
    rows = _in_name_order(walk())
    if len(rows) > f.limit:
        return rows
    return [*rows, *walk(named=False)][:f.limit + 1]


def _cursor(sort: str, last: sa.RowMapping) -> str:
    if sort == NAME:
        return encode_name_cursor(last["provider_id"], last["id"])
    return encode_cursor(last["created_at"], last["id"])


def _allowed_states(f: MachineFilter, states: dict[int, int]) -> list[int]:
    """The ``tag_bits`` values that occur and satisfy the tag and hold filters, and what
    the health filters imply: a heartbeat tag for heartbeating; an agent started and no
    hold for silent (the Recovery backlog's own conditions)."""
    need = sum(_TAG_BIT[t] for t in set(f.tags))
    refuse = sum(_TAG_BIT[t] for t in set(f.without))
    if f.health == HEARTBEATING:
        need |= _TAG_BIT["AgentHeartbeat"]
    if f.health == SILENT:
        need |= _TAG_BIT["AgentStarted"]
        refuse |= counters.HELD
    held = counters.HELD if f.held == ANY else counters.HOLD_BITS.get(f.held or "", 0)
    return sorted(s for s in states if s & need == need and not s & refuse
                  and (not held or s & held))


def _columns() -> AnySelect:
    m, p = schema.machines, schema.provided
    return sa.select(m.c.id, m.c.created_at, m.c.tag_bits, p.c.provider, p.c.provider_id,
                     p.c.provider_status, p.c.address
                     ).select_from(m.outerjoin(p, p.c.machine_id == m.c.id))


def _conditions(tx: Tx, f: MachineFilter, thresholds: backlog.Thresholds | None
                ) -> list[sa.ColumnElement[bool]]:
    """The filters beyond tags and holds: provider, work, backoff, health."""
    m, p = schema.machines, schema.provided
    where: list[sa.ColumnElement[bool]] = []
    if f.provider:
        where.append(p.c.provider == f.provider)
    if f.work:
        w = schema.work
        held = sa.exists().where(w.c.machine_id == m.c.id)
        where.append(held.where(w.c.process == f.work) if f.work != ANY else held)
    if f.backoff:
        b = schema.backoff
        waiting = sa.exists().where(b.c.machine_id == m.c.id, b.c.until > tx.now)
        where.append(waiting.where(b.c.process == f.backoff) if f.backoff != ANY else waiting)
    if f.health:
        where.append(_health(tx, f.health, thresholds))
    return where


def _health(tx: Tx, health: str, thresholds: backlog.Thresholds | None
            ) -> sa.ColumnElement[bool]:
    """The machines of ``health`` (``fleet.HealthCounts``), by the statements the counts
    run: a heartbeat since the cutoff, the Recovery backlog query, ``INSTALLING``."""
    m = schema.machines
    if health == fleet.INSTALLING:
        return m.c.id.in_(sa.select(backlog.INSTALLING.subquery().c.machine_id))
    assert thresholds is not None  # _listed refused heartbeating and silent without them
    if health == HEARTBEATING:
        h = schema.agent_heartbeat
        return sa.exists().where(h.c.machine_id == m.c.id,
                                 h.c.last_heartbeat_at >= fleet.heartbeat_cutoff(tx, thresholds))
    silent = backlog.recovery(tx, thresholds).subquery()
    return m.c.id.in_(sa.select(silent.c.machine_id))


def _page(tx: Tx, f: MachineFilter, allowed: list[int],
          thresholds: backlog.Thresholds | None, named: bool = True) -> AnySelect:
    """One page plus one row (to know whether another page follows); by name, one of
    its two walks (``named``: ``_by_name``)."""
    m = schema.machines
    where = _conditions(tx, f, thresholds)
    size = f.limit + 1
    if f.sort == NAME:
        return _by_name(f, [m.c.tag_bits.in_(allowed), *where], size, named)
    if f.after is not None:
        created_at, machine_id = decode_cursor(f.after)
        where.append(sa.tuple_(m.c.created_at, m.c.id) > sa.tuple_(
            sa.literal(created_at, m.c.created_at.type), sa.literal(machine_id, m.c.id.type)))
    order = (m.c.created_at, m.c.id)
    if f.driven:  # driven by the work / backoff / silent / installing rows: few
        return _columns().where(m.c.tag_bits.in_(allowed), *where).order_by(*order).limit(size)
    walks = [sa.select(_columns().where(m.c.tag_bits == state, *where)
                       .order_by(*order).limit(size).subquery()) for state in allowed]
    merged = sa.union_all(*walks).subquery()
    return sa.select(merged).order_by(merged.c.created_at, merged.c.id).limit(size)


def _by_name(f: MachineFilter, where: list[sa.ColumnElement[bool]], size: int,
             named: bool) -> AnySelect:
    """One of the two walks of a page in ``NAME`` order (``_rows``). That order: by
    provider (or inventory) id, digit runs by their value (``_types.natural_key``:
    ``rack1-u2``, ``rack1-u10``, ``rack2-u1``, ``rack10-u1``), ties (two providers'
    equal ids, ``u07`` and ``u7``) by machine id, machines without a provider id
    last, by id. The cursor holds the last row's provider id and machine id; the next
    page is what follows that position, so no row is skipped or repeated, whatever
    ties or rows without an id there are.

    With ``named``, the machines with a provider (or inventory) id in the order of
    ``ix_provided_natural_key`` (PostgreSQL: the key and machine_id, the cursor a row
    comparison on both, so a page is a walk of the index at any fleet size; the
    planner may instead sort what a selective filter lets through; SQLite computes
    the key for every named machine the filters let through, see migration 0019);
    else the machines without one, by id (a pass over what the filters let through:
    no index finds machines without an id). ``size`` rows at most, each walk after
    the cursor's position."""
    m, p = schema.machines, schema.provided
    key = natural_key(p.c.provider_id)
    where = [*where, p.c.provider_id.is_not(None) if named else p.c.provider_id.is_(None)]
    if f.after is not None:
        provider_id, machine_id = decode_name_cursor(f.after)
        after_id = sa.literal(machine_id, m.c.id.type)
        if provider_id is None:  # past every named machine
            where.append(sa.false() if named else m.c.id > after_id)
        elif named:
            after_key = natural_key(sa.literal(provider_id, p.c.provider_id.type))
            where.append(sa.tuple_(key, p.c.machine_id) > sa.tuple_(after_key, after_id))
    order = (key, p.c.machine_id) if named else (m.c.id,)
    return _columns().where(*where).order_by(*order).limit(size)


def _in_name_order(rows: Sequence[sa.RowMapping]) -> list[sa.RowMapping]:
    """The named walk's rows in ``NAME`` order, the key not sent back by the SQL:
    ``natural_key_text`` computes the SQL's own key on both backends
    (``tests/bmdb/test_paging.py`` checks them against each other), compared by code
    point as PostgreSQL's ``COLLATE "C"`` compares UTF-8 bytes, ties by id as the
    index orders them."""
    return sorted(rows, key=lambda row: (natural_key_text(row["provider_id"]), row["id"]))


def _with_work_and_backoffs(tx: Tx, page: AnySelect, sort: str, glances: bool = False
                            ) -> AnySelect:
    """The page's rows, each with its work's and active backoffs' processes (comma
    separated), and with ``glances`` the glance's columns (``queries.glance_joins``),
    in the same statement: per row a few index probes, instead of sending the page's
    ids back in more statements."""
    rows = page.subquery()
    w, b = schema.work, schema.backoff
    work = (sa.select(sa.func.aggregate_strings(w.c.process, ","))
            .where(w.c.machine_id == rows.c.id).scalar_subquery())
    backoffs = (sa.select(sa.func.aggregate_strings(b.c.process, ","))
                .where(b.c.machine_id == rows.c.id,
                       b.c.until > sa.literal(tx.now, b.c.until.type)).scalar_subquery())
    query = sa.select(rows, work.label("work"), backoffs.label("backoffs"))
    if glances:
        joined, columns = glance_joins(rows, rows.c.id)
        query = query.add_columns(*columns).select_from(joined)
    if sort == NAME:
        return query.order_by(rows.c.id)  # the unnamed walk's order; _rows sorts the named
    return query.order_by(rows.c.created_at, rows.c.id)


#: Up to this many matches, a provider filter's count is exact (a bounded walk).
EXACT_UP_TO = 5000


def _matched(tx: Tx, f: MachineFilter, states: dict[int, int], allowed: list[int],
             thresholds: backlog.Thresholds | None) -> tuple[int, bool]:
    """(machines matching ``f``, whether that is an estimate).

    Tag and hold filters are counted by the counters, heartbeating by them too (minus
    the stale heartbeats: ``fleet.heartbeating``), as the health figures are; work,
    backoff, silent and installing filters over their (small) sets. A provider filter
    (or heartbeating with one) is counted up to ``EXACT_UP_TO``; past that it is the
    planner's estimate, since counting every machine of a large provider would cost a
    walk over all of them."""
    if not allowed:
        return 0, False
    beyond_health = f.provider or f.work or f.backoff
    if not (beyond_health or f.health):
        return sum(states[s] for s in allowed), False
    if f.health == HEARTBEATING and not beyond_health:
        assert thresholds is not None  # _page refused the filter without them
        return fleet.heartbeating(tx, states, thresholds, among=allowed), False
    query = _columns().where(schema.machines.c.tag_bits.in_(allowed),
                             *_conditions(tx, f, thresholds))
    bounded = not f.driven and tx.dialect == "postgresql"
    counted = query.limit(EXACT_UP_TO + 1) if bounded else query
    n = int(tx.execute(sa.select(sa.func.count()).select_from(counted.subquery())).scalar_one())
    if n <= EXACT_UP_TO or not bounded:
        return n, False
    return max(_estimated_rows(tx, query), n), True


def _estimated_rows(tx: Tx, query: AnySelect) -> int:
    """The PostgreSQL planner's row estimate for ``query`` (no rows are read)."""
    compiled = query.compile(dialect=tx.conn.dialect, compile_kwargs={"literal_binds": True})
    plan = tx.execute(sa.text(f"EXPLAIN (FORMAT JSON) {compiled}")).scalar_one()
    return int(plan[0]["Plan"]["Plan Rows"])


def _summaries(rows: Sequence[sa.RowMapping]) -> list[MachineSummary]:
    return [
        MachineSummary(id=row["id"], created_at=row["created_at"], provider=row["provider"],
                       provider_id=row["provider_id"], provider_status=row["provider_status"],
                       address=row["address"], tags=list(_tags_of(row["tag_bits"])),
                       work=_processes(row["work"]), backoffs=_processes(row["backoffs"]),
                       holds=list(_holds_of(row["tag_bits"])))
        for row in rows
    ]


def _processes(joined: str | None) -> list[str]:
    return sorted(joined.split(",")) if joined else []


@functools.cache
def _tags_of(bits: int) -> tuple[str, ...]:
    """Tag names set in ``bits``, in ``TAG_TABLES`` order (a page has few distinct values)."""
    return tuple(t for t in TAG_TABLES if bits & _TAG_BIT[t])


@functools.cache
def _holds_of(bits: int) -> tuple[str, ...]:
    return tuple(k for k, bit in counters.HOLD_BITS.items() if bits & bit)


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
    the text itself, with bounds (``shepherd.operations.stored``). SQLite's column is
    read as bytes, decoded with replacement: a value stored there as a BLOB need not
    be UTF-8, and the driver would fail on it.
    """
    row = tx.execute(_stored_tags_query(tx.dialect), {"machine": machine_id}).one()._mapping
    return {name: {column: _stored(row[label]) if column in _JSON_COLUMNS[name] else row[label]
                   for column, label in _labels(name)}
            for name in TAG_TABLES if row[f"{name}__machine_id"] is not None}


#: Tag name -> the names of its JSON columns.
_JSON_COLUMNS = {name: frozenset(c.name for c in table.c if isinstance(c.type, sa.JSON))
                 for name, table in TAG_TABLES.items()}


@functools.cache
def _labels(name: str) -> tuple[tuple[str, str], ...]:
    """(column, its label in ``_stored_tags_query``) of tag ``name``, but machine_id."""
    return tuple((c.name, f"{name}__{c.name}") for c in TAG_TABLES[name].c
                 if c.name != "machine_id")


@functools.cache
def _stored_tags_query(dialect: str) -> AnySelect:
    """Every tag table's row of one machine in one statement (a machine page reads
    them twice, and a statement per table was a fifth of its round trips): from one
    row, a left join of each table on the machine's id, each column labelled
    ``TAG__COLUMN``, machine_id saying whether the tag is there, JSON columns cast to
    text (bytes on SQLite), so that no driver decodes them. Built once per dialect."""
    raw = sa.LargeBinary if dialect == "sqlite" else sa.Text
    machine = sa.bindparam("machine", type_=schema.machines.c.id.type)
    joined: sa.FromClause = sa.select(sa.literal(1).label("one")).subquery("one_row")
    columns: list[sa.ColumnElement[Any]] = []
    for name, table in TAG_TABLES.items():
        joined = joined.outerjoin(table, table.c.machine_id == machine)
        columns += [sa.cast(c, raw).label(f"{name}__{c.name}") if c.name in _JSON_COLUMNS[name]
                    else c.label(f"{name}__{c.name}") for c in table.c]
    return sa.select(*columns).select_from(joined)


def _stored(value: str | bytes | None) -> StoredJSON | None:
    if value is None:  # the columns are NOT NULL; SQL NULL is no document either way
        return None
    return StoredJSON(value.decode("utf-8", "replace") if isinstance(value, bytes) else value)
