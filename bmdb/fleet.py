"""Fleet-wide figures: what dashboards, metrics and the blast-radius guard count.

Counted over whole tables (or a whole backlog), from the BMDB rather than any
process's memory, so that every worker on every host sees the same numbers. The
guard's three figures run on every sourcing of Recovery: their statements are
built once (see ``backlog.Backlog`` for why).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

import sqlalchemy as sa

from bmdb import backlog, schema
from bmdb.database import Tx
from bmdb.holds import HOLD_KINDS
from bmdb.processes import Process
from bmdb.work import Event, eligible

#: History events that end a work item (what ``task_outcomes`` reports besides Started).
ENDINGS: tuple[str, ...] = (Event.FINISHED, Event.FAILED, Event.CANCELED, Event.ABANDONED)


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

    Counts whole tables: for dashboards and metrics, not for hot paths.
    """

    def count(query: sa.Select) -> int:
        return tx.execute(sa.select(sa.func.count()).select_from(query.subquery())).scalar_one()

    def per_process(table: sa.Table, *where: sa.ColumnElement[bool]) -> dict[str, int]:
        rows = tx.execute(
            sa.select(table.c.process, sa.func.count()).where(*where).group_by(table.c.process)
        )
        found = {row[0]: row[1] for row in rows}
        return {p.value: found.get(p.value, 0) for p in Process}

    hb = schema.agent_heartbeat
    fresh = tx.execute(
        sa.select(sa.func.count()).where(
            hb.c.last_heartbeat_at >= tx.now - dt.timedelta(seconds=thresholds.heartbeat)
        )
    ).scalar_one()
    return FleetCounts(
        machines=count(sa.select(schema.machines.c.id)),
        provided=count(sa.select(schema.provided.c.machine_id)),
        agent_started=count(sa.select(schema.agent_started.c.machine_id)),
        heartbeating=fresh,
        backlog={
            process.value: count(eligible(tx, process, backlog.retriever(process, thresholds)))
            for process in (Process.AGENT_START, Process.RECOVERY)
        },
        active_work=per_process(schema.work),
        active_backoffs=per_process(schema.backoff, schema.backoff.c.until > tx.now),
        held=held_counts(tx),
    )


def held_counts(tx: Tx) -> dict[str, int]:
    """Machines per hold kind, every kind present (zero when none)."""
    holds = schema.machine_holds
    rows = tx.execute(sa.select(holds.c.kind, sa.func.count()).group_by(holds.c.kind))
    found = {row[0]: int(row[1]) for row in rows}
    return {kind: found.get(kind, 0) for kind in HOLD_KINDS}


_OUTCOMES = (sa.select(schema.history.c.process, schema.history.c.event, sa.func.count())
             .group_by(schema.history.c.process, schema.history.c.event))


def task_outcomes(tx: Tx) -> dict[tuple[str, str], int]:
    """(process, event) -> count over the whole history, every known (process, Started or
    one of ``ENDINGS``) pair present, zero when it never happened.

    History is written in the same transaction as each outcome, by every worker, so
    these are fleet-wide totals that survive restarts. Counts the whole table.
    """
    counts = {(p.value, e): 0 for p in Process for e in (Event.STARTED, *ENDINGS)}
    for process, event, count in tx.execute(_OUTCOMES):
        counts[(process, event)] = int(count)
    return counts


# -- the blast-radius guard's figures --------------------------------------------------

_AGENTS_STARTED = sa.select(sa.func.count()).select_from(schema.agent_started).where(
    backlog.not_held(schema.agent_started.c.machine_id))


def agents_started(tx: Tx, among: Iterable[uuid.UUID] | None = None) -> int:
    """Machines with an AgentStarted tag and no hold: the guard's denominator (or,
    ``among`` given, how many of those machines have one).

    Held machines (maintenance, quarantine) are left out of both sides of the silent
    share: an operator's planned work on a rack must not read as a fleet outage.
    """
    if among is None:
        return int(tx.execute(_AGENTS_STARTED).scalar_one())
    s = schema.agent_started
    return int(tx.execute(_AGENTS_STARTED.where(s.c.machine_id.in_(list(among)))).scalar_one())


def _silent_statement() -> sa.Select:
    silent = backlog.RECOVERY.subquery()
    return sa.select(sa.func.count(sa.distinct(silent.c.machine_id)))


_SILENT = _silent_statement()


def silent_machines(tx: Tx, thresholds: backlog.Thresholds) -> int:
    """Distinct machines the Recovery backlog query selects, whether or not they are
    claimed or backing off: a silent machine in backoff is still silent. Machines in
    maintenance or quarantine are not in that query, so not counted."""
    return int(tx.execute(_SILENT, backlog.recovery_cutoffs(tx, thresholds)).scalar_one())


#: The window of the hourly reboot budget.
HOUR = dt.timedelta(hours=1)


def _recovery_starts_statement() -> sa.Select:
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

    Counted from history so every worker on every host shares one budget. History
    has no index on ``at``; at very large history sizes this wants one on
    (process, event, at).
    """
    return int(tx.execute(_RECOVERY_STARTS, {"since": tx.now - HOUR}).scalar_one())
