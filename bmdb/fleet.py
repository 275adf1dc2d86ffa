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
from collections.abc import Collection, Iterable, Mapping
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
        heartbeating=heartbeating(tx, states, thresholds),
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
_STALE_AMONG = (sa.select(sa.func.count())
                .select_from(schema.agent_heartbeat.join(
                    schema.machines, schema.machines.c.id == schema.agent_heartbeat.c.machine_id))
                .where(schema.agent_heartbeat.c.last_heartbeat_at < sa.bindparam("cutoff"),
                       schema.machines.c.tag_bits.in_(sa.bindparam("among", expanding=True))))


def heartbeat_cutoff(tx: Tx, thresholds: backlog.Thresholds) -> dt.datetime:
    """A heartbeat at or after this is fresh; before it, stale (the agent went quiet)."""
    return tx.now - dt.timedelta(seconds=thresholds.heartbeat)


def heartbeating(tx: Tx, states: Mapping[int, int], thresholds: backlog.Thresholds,
                 among: Collection[int] | None = None) -> int:
    """Machines whose last heartbeat is within ``thresholds.heartbeat`` (of those whose
    ``tag_bits`` is one of ``among``, when given): their heartbeat tags, from the
    counters, minus the stale ones, which the index on ``last_heartbeat_at`` finds
    without reading the (many) fresh ones (with ``among``, a primary-key probe each)."""
    bit = counters.TAG_BITS["agent_heartbeat"]
    cutoff = heartbeat_cutoff(tx, thresholds)
    if among is None:
        tagged = counters.machines_with(states, bit)
        stale = tx.execute(_STALE, {"cutoff": cutoff}).scalar_one()
    else:
        tagged = sum(states.get(s, 0) for s in among if s & bit)
        stale = tx.execute(_STALE_AMONG, {"cutoff": cutoff, "among": list(among)}).scalar_one()
    return tagged - int(stale)


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


# -- the fleet's health, as the machine list leads with it --------------------------

#: ``MachineFilter.health``'s values: the health figures no other filter of the list
#: gives (in Recovery is ``work=ShepherdRecovery``, held ``held=any``, backing off
#: ``backoff=any``).
HEARTBEATING, SILENT, INSTALLING = "heartbeating", "silent", "installing"
HEALTH = (HEARTBEATING, SILENT, INSTALLING)


@dataclass(frozen=True)
class HealthCounts:
    """Machines in each state an operator reads "is my fleet healthy?" from, in the
    words the rest of Shepherd uses. They overlap (a silent machine may be held by
    Recovery work, or back off), and each is what the list's filter for it lists:

    * heartbeating: a heartbeat within ``heartbeat_timeout`` (``health=heartbeating``);
    * silent: in the Recovery backlog query, claimed, backing off or not: the guard's
      silent machines (``health=silent``);
    * in Recovery: held by Recovery work (``work=ShepherdRecovery``);
    * installing: an installation between its steps (``health=installing``,
      ``backlog.INSTALLING``);
    * held: any hold, so in no backlog (``held=any``);
    * backing off: an active backoff of any process (``backoff=any``).
    """

    heartbeating: int
    silent: int
    in_recovery: int
    installing: int
    held: int
    backing_off: int


_IN_RECOVERY = sa.select(sa.func.count()).where(
    schema.work.c.process == Process.RECOVERY.value)
_INSTALLING = sa.select(sa.func.count()).select_from(backlog.INSTALLING.subquery())
# Every process named: the index on (process, until) then reads only active backoffs.
_BACKING_OFF = sa.select(sa.func.count(sa.distinct(schema.backoff.c.machine_id))).where(
    schema.backoff.c.process.in_([p.value for p in Process]),
    schema.backoff.c.until > sa.bindparam("now"))
# One statement, one round trip: a page shows the figures on every view.
_HEALTH = sa.select(*(statement.scalar_subquery().label(name) for name, statement in (
    ("stale", _STALE), ("silent", _SILENT), ("in_recovery", _IN_RECOVERY),
    ("installing", _INSTALLING), ("backing_off", _BACKING_OFF))))


def health_counts(tx: Tx, thresholds: backlog.Thresholds) -> HealthCounts:
    """The six figures, none counting the fleet (every list page shows them, at most
    a couple of seconds old): heartbeating and held from the counters,
    minus the stale heartbeats through their index; silent through the Recovery
    backlog's indexes (a row per silent candidate: ``silent_machines``' statement); in
    Recovery over the work table (a row per work item in flight); installing through
    the pending wishes' partial index and the work; backing off through the backoffs'
    index (a row per active one). The five that are not counters are one statement."""
    states = counters.states(tx)
    cutoffs = backlog.recovery_cutoffs(tx, thresholds)
    row = tx.execute(_HEALTH, {**cutoffs, "cutoff": heartbeat_cutoff(tx, thresholds),
                               "now": tx.now}).one()
    return HealthCounts(
        heartbeating=counters.machines_with(states, counters.TAG_BITS["agent_heartbeat"])
        - int(row.stale),
        silent=int(row.silent), in_recovery=int(row.in_recovery),
        installing=int(row.installing),
        held=sum(n for state, n in states.items() if state & counters.HELD),
        backing_off=int(row.backing_off))


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
