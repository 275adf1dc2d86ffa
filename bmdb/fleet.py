"""Fleet-wide figures: what dashboards, metrics and the blast-radius guard count.

From the BMDB rather than any process's memory, so that every worker on every host
sees the same numbers; never by counting a whole table (``counters`` keeps those). The
guard's three figures run on every sourcing of Recovery: their statements are
built once (see ``backlog.Backlog`` for why).

What went wrong lately, fleet-wide, is here too: the newest failures of a process, and
sessions that died still holding work. ``shepherd up``'s live progress (and anything
else that watches the fleet) must say *why* machines sit in backoff without an operator
opening a worker log, and must do so every few seconds at any fleet size. So every
read is bounded: the newest failures walk the history index on (process, event, at)
backwards and stop after ``limit`` rows; dead sessions are found through the index on
their deadline, and the work they hold is a few rows (work is bounded by the workers'
concurrency).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

import sqlalchemy as sa

from bmdb import _counters as counters
from bmdb import _schema as schema
from bmdb import backlog
from bmdb._database import Tx
from bmdb._types import AnySelect
from bmdb.vocabulary import ENDINGS, HOUR, Event, Process
from bmdb.work import eligible


@dataclass(frozen=True)
class FleetCounts:
    machines: int
    provided: int
    agent_started: int
    heartbeating: int
    backlog: dict[str, int]
    active_work: dict[str, int]
    active_backoffs: dict[str, int]
    #: Machines per hold kind (``maintenance``, ``quarantine``).
    held: dict[str, int] = dataclasses.field(default_factory=dict)


def fleet_counts(tx: Tx, thresholds: backlog.Thresholds) -> FleetCounts:
    """What an operator wants on one screen; the backlog counts what is claimable now.

    Flat in the fleet's size: machine and tag figures come from the trigger-kept
    ``counters``; the rest count only rows that are few in a working fleet (backlogs,
    work, backoffs, heartbeats gone stale), each through an index.
    """
    def count(query: AnySelect) -> int:
        counted: int = tx.execute(
            sa.select(sa.func.count()).select_from(query.subquery())).scalar_one()
        return counted

    def per_process(table: sa.Table, *where: sa.ColumnElement[bool]) -> dict[str, int]:
        rows = tx.execute(
            sa.select(table.c.process, sa.func.count()).where(*where).group_by(table.c.process)
        )
        found = {row[0]: row[1] for row in rows}
        return {p.value: found.get(p.value, 0) for p in Process}

    states = counters.states(tx)
    return FleetCounts(
        machines=sum(states.values()),
        provided=counters.machines_with(states, counters.TAG_BITS["provided"]),
        agent_started=counters.machines_with(states, counters.TAG_BITS["agent_started"]),
        heartbeating=_heartbeating(tx, states, thresholds),
        backlog={
            process.value: count(eligible(tx, process, backlog.retriever(process, thresholds)))
            for process in (Process.AGENT_START, Process.RECOVERY)
        },
        active_work=per_process(schema.work),
        active_backoffs=per_process(schema.backoff, schema.backoff.c.until > tx.now),
        held=counters.hold_counts(states),
    )


_STALE = sa.select(sa.func.count()).where(
    schema.agent_heartbeat.c.last_heartbeat_at < sa.bindparam("cutoff"))


def _heartbeating(tx: Tx, states: dict[int, int], thresholds: backlog.Thresholds) -> int:
    """Machines whose last heartbeat is within ``thresholds.heartbeat``: all heartbeat
    tags minus the stale ones, which the index on ``last_heartbeat_at`` finds without
    reading the (many) fresh ones."""
    cutoff = tx.now - dt.timedelta(seconds=thresholds.heartbeat)
    stale = tx.execute(_STALE, {"cutoff": cutoff}).scalar_one()
    return counters.machines_with(states, counters.TAG_BITS["agent_heartbeat"]) - int(stale)


def held_counts(tx: Tx) -> dict[str, int]:
    """Machines per hold kind, every kind present (zero when none)."""
    return counters.hold_counts(counters.states(tx))


def task_outcomes(tx: Tx) -> dict[tuple[str, str], int]:
    """(process, event) -> count over all history ever written, every known (process,
    Started or one of ``ENDINGS``) pair present, zero when it never happened.

    History is written in the same transaction as each outcome, by every worker, so
    these are fleet-wide totals that survive restarts; the counter behind them
    (``counters.history_totals``) is not lowered by pruning history.
    """
    counts = {(p.value, e.value): 0 for p in Process for e in (Event.STARTED, *ENDINGS)}
    counts.update(counters.history_totals(tx))
    return counts


# -- the blast-radius guard's figures --------------------------------------------------

_AGENTS_STARTED_AMONG = sa.select(sa.func.count()).select_from(schema.agent_started).where(
    backlog.not_held(schema.agent_started.c.machine_id))


def agents_started(tx: Tx, among: Iterable[uuid.UUID] | None = None) -> int:
    """Machines with an AgentStarted tag and no hold: the guard's denominator (or,
    ``among`` given, how many of those machines have one).

    Held machines (maintenance, quarantine) are left out of both sides of the silent
    share: an operator's planned work on a rack must not read as a fleet outage.
    The fleet-wide figure comes from the counters, so the guard costs the same at
    any fleet size.
    """
    if among is None:
        return counters.machines_with(counters.states(tx), counters.TAG_BITS["agent_started"],
                                      without=counters.HELD)
    s = schema.agent_started
    return int(tx.execute(_AGENTS_STARTED_AMONG.where(s.c.machine_id.in_(list(among))))
               .scalar_one())


def _silent_statement() -> AnySelect:
    silent = backlog.RECOVERY.subquery()
    return sa.select(sa.func.count(sa.distinct(silent.c.machine_id)))


_SILENT = _silent_statement()


def silent_machines(tx: Tx, thresholds: backlog.Thresholds) -> int:
    """Distinct machines the Recovery backlog query selects, whether or not they are
    claimed or backing off: a silent machine in backoff is still silent. Machines in
    maintenance or quarantine are not in that query, so not counted."""
    return int(tx.execute(_SILENT, backlog.recovery_cutoffs(tx, thresholds)).scalar_one())


def _recovery_starts_statement() -> AnySelect:
    h = schema.history
    started = h.alias("started")
    canceled = sa.exists().where(h.c.work_id == started.c.work_id, h.c.event == Event.CANCELED)
    return sa.select(sa.func.count()).select_from(started).where(
        started.c.process == Process.RECOVERY.value,
        started.c.event == Event.STARTED,
        started.c.at > sa.bindparam("since"),
        ~canceled,
    )


_RECOVERY_STARTS = _recovery_starts_statement()


def recovery_starts_last_hour(tx: Tx) -> int:
    """Recovery claims (``Started``) in the last hour, fleet-wide, minus those cancelled
    before doing anything (broker refusal, never adopted, paused at execution).

    Counted from history so every worker on every host shares one budget; the
    indexes on history (process, event, at) and (work_id) read only the last hour's
    Recovery starts, whatever the history's size.
    """
    return int(tx.execute(_RECOVERY_STARTS, {"since": tx.now - HOUR}).scalar_one())


# -- what went wrong lately -------------------------------------------------------


@dataclass(frozen=True)
class Failure:
    """One ``Failed`` history row: the work item's failure cause, as the worker wrote it."""

    machine_id: uuid.UUID
    at: dt.datetime
    cause: str


_h = schema.history
_LATEST_FAILURES = (
    sa.select(_h.c.machine_id, _h.c.at, _h.c.cause)
    .where(_h.c.process == sa.bindparam("process"), _h.c.event == Event.FAILED)
    .order_by(_h.c.at.desc())
    .limit(sa.bindparam("limit"))
)


def latest_failures(tx: Tx, process: Process | str, limit: int = 50) -> list[Failure]:
    """The newest ``limit`` failures of ``process``, newest first (pruned history is gone).

    Reads at most ``limit`` rows through ``ix_history_process_event_at``, whatever the
    history's size. The cause is as stored (it may span lines); how to shorten it is
    the caller's business.
    """
    rows = tx.execute(_LATEST_FAILURES, {"process": Process(process).value, "limit": limit})
    return [Failure(row.machine_id, row.at, row.cause or "") for row in rows]


@dataclass(frozen=True)
class DeadSessions:
    """Sessions past their deadline that the sweep has not deleted yet, and the work
    items they still hold (machines nobody works on until the sweep releases them)."""

    sessions: int
    work: int
    #: The deadline of the oldest of them (None: none is dead): how long no sweep ran.
    oldest_deadline: dt.datetime | None = None


_s, _w = schema.sessions, schema.work
_DEAD = (sa.select(sa.func.count(), sa.func.min(_s.c.deadline))
         .where(_s.c.deadline <= sa.bindparam("now")))
_ALIVE = sa.select(sa.func.count()).where(_s.c.deadline > sa.bindparam("now"))
_DEAD_WORK = (sa.select(sa.func.count()).select_from(_w.join(_s, _s.c.id == _w.c.session_id))
              .where(_s.c.deadline <= sa.bindparam("now")))


def dead_sessions(tx: Tx) -> DeadSessions:
    """Dead but unswept sessions and their work, on the BMDB's clock. Nonzero for long
    means no sweep runs (beat or the sweeping worker is down)."""
    now = {"now": tx.now}
    sessions, oldest = tx.execute(_DEAD, now).one()
    return DeadSessions(sessions=int(sessions), work=int(tx.execute(_DEAD_WORK, now).scalar_one()),
                        oldest_deadline=oldest)


def alive_sessions(tx: Tx) -> int:
    """Sessions whose deadline has not passed (one per live worker or server process)."""
    return int(tx.execute(_ALIVE, {"now": tx.now}).scalar_one())
