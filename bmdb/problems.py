"""What went wrong lately, fleet-wide: the newest failures of a process, and sessions
that died still holding work.

Why here: ``shepherd up``'s live progress (and anything else that watches the fleet)
must say *why* machines sit in backoff without an operator opening a worker log, and
must do so every few seconds at any fleet size. So every read is bounded: the newest
failures walk the history index on (process, event, at) backwards and stop after
``limit`` rows; dead sessions are found through the index on their deadline, and the
work they hold is a few rows (work is bounded by the workers' concurrency).
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass

import sqlalchemy as sa

from bmdb import schema
from bmdb.database import Tx
from bmdb.processes import Process
from bmdb.work import Event


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
