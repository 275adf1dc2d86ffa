"""The power and health sync's book: when each machine's BMC is read next, and what
the last read found (one row per machine in ``bmc_syncs``).

Why in the BMDB: the sync runs in whichever worker beat's message reaches, several at
once on a large fleet, and a BMC must be read no more often than the interval says
however many run. So the schedule is rows, and a read is *claimed* by moving its row's
``due_at`` one interval (plus jitter) ahead in the claiming transaction
(``claim_due``, ``FOR UPDATE SKIP LOCKED`` on PostgreSQL). Invariant: a machine's BMC is
read at most once per claim, and a row is claimed again only once its new ``due_at``
has passed, so two syncs never read one machine's BMC within an interval. A worker
killed mid-read loses nothing but that read: the row is due again an interval later,
and nothing stays locked.

What a read found is kept beside the schedule, so pages and ``/metrics`` show it
without calling a BMC: the health and its words, how long the BMC took, and its
*status*: ``answering``, ``slow`` (answered, later than the slow threshold),
``unreachable``, ``auth-refused`` or ``failing`` (any other error). Recovery reads the
status before its ladder (``NOT_ANSWERING``: it can only restart the agent there). A
status changes only with
another read, so a BMC that answers again clears itself; each change is a history row
(topic ``Bmc``). A *contradiction* (the BMC says Off while the agent heartbeats) is
the sync's finding, kept with its words until a read no longer finds it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import sqlalchemy as sa

from bmdb import _schema as schema
from bmdb import history
from bmdb._database import Tx
from bmdb.vocabulary import Event, Topic

ANSWERING, SLOW = "answering", "slow"
#: No answer; credentials refused; any other error (a wrong system path, a 404...).
UNREACHABLE, AUTH_REFUSED, FAILING = "unreachable", "auth-refused", "failing"
STATUSES = (ANSWERING, SLOW, UNREACHABLE, AUTH_REFUSED, FAILING)
#: Statuses of a BMC that cannot act: Recovery restarts the agent there, and no more.
NOT_ANSWERING = frozenset({UNREACHABLE, AUTH_REFUSED, FAILING})
MAX_TEXT = 512
MAX_HEALTH_DETAIL = 256
MAX_VIA = 256


@dataclass(frozen=True)
class BmcSync:
    machine_id: uuid.UUID
    due_at: dt.datetime
    #: The BMC's status after the last read (``STATUSES``), and since when.
    status: str
    status_since: dt.datetime | None
    #: The last read that answered (None: none yet).
    read_at: dt.datetime | None
    #: "OK", "Warning", "Critical", or None (not reported, or never read).
    health: str | None
    health_detail: str | None
    #: Why the last read failed, or took long; None after a prompt answer.
    problem: str | None
    answer_seconds: float | None
    #: The sync's finding that the BMC contradicts the agent, in words; None: none.
    contradiction: str | None
    via: str | None

    @property
    def answering(self) -> bool:
        """Whether the BMC answered its last read (slowly counts)."""
        return self.status not in NOT_ANSWERING


FIELDS = tuple(f.name for f in dataclasses.fields(BmcSync))


@dataclass(frozen=True)
class Reading:
    """What one read of a BMC found, as the sync writes it (``record``)."""

    status: str
    seconds: float
    via: str
    health: str | None = None
    health_detail: str | None = None
    problem: str | None = None
    contradiction: str | None = None


def enroll(tx: Tx, first_due_in: Mapping[uuid.UUID, float]) -> int:
    """Put each machine not in the book yet in it, first due that many seconds from now
    (the sync spreads a new fleet's first reads over an interval); how many were new."""
    b = schema.bmc_syncs
    known = {row.machine_id for row in tx.execute(
        sa.select(b.c.machine_id).where(b.c.machine_id.in_(list(first_due_in))))}
    m = schema.machines
    existing = {row.id for row in tx.execute(
        sa.select(m.c.id).where(m.c.id.in_([i for i in first_due_in if i not in known])))}
    rows = [{"machine_id": machine_id, "due_at": tx.now + dt.timedelta(seconds=seconds),
             "status": ANSWERING}
            for machine_id, seconds in first_due_in.items() if machine_id in existing]
    if rows:
        tx.execute(sa.insert(b), rows)
    return len(rows)


def claim_due(tx: Tx, limit: int, next_in: Callable[[], float]) -> list[uuid.UUID]:
    """Up to ``limit`` machines whose read is due, oldest first, each moved ``next_in()``
    seconds ahead in this transaction (its claim: see the module docstring)."""
    b = schema.bmc_syncs
    due = [row.machine_id for row in tx.execute(
        sa.select(b.c.machine_id).where(b.c.due_at <= tx.now).order_by(b.c.due_at)
        .limit(limit).with_for_update(skip_locked=True))]
    if due:
        tx.execute(sa.update(b).where(b.c.machine_id == sa.bindparam("id"))
                   .values(due_at=sa.bindparam("due")),
                   [{"id": machine_id, "due": tx.now + dt.timedelta(seconds=next_in())}
                    for machine_id in due])
    return due


def postpone(tx: Tx, machine_id: uuid.UUID, seconds: float) -> None:
    """Read it again ``seconds`` from now instead (its BMC was busy with another call)."""
    b = schema.bmc_syncs
    tx.execute(sa.update(b).where(b.c.machine_id == machine_id)
               .values(due_at=tx.now + dt.timedelta(seconds=seconds)))


def drop(tx: Tx, machine_id: uuid.UUID) -> None:
    """Out of the book: the machine has no BMC (any more) to read."""
    b = schema.bmc_syncs
    tx.execute(sa.delete(b).where(b.c.machine_id == machine_id))


def record(tx: Tx, machine_id: uuid.UUID, reading: Reading) -> BmcSync | None:
    """Write what a read found; a change of status or contradiction is a history row.
    The row as it was before (None: the machine left the book meanwhile)."""
    before = of_machine(tx, machine_id)
    if before is None:
        return None
    answered = reading.status not in NOT_ANSWERING
    values: dict[str, object] = {
        "status": reading.status, "answer_seconds": reading.seconds,
        "problem": _cut(reading.problem, MAX_TEXT), "via": reading.via[:MAX_VIA],
        "status_since": before.status_since if before.status == reading.status else tx.now,
    }
    if answered:
        values.update(read_at=tx.now, health=reading.health,
                      health_detail=_cut(reading.health_detail, MAX_HEALTH_DETAIL),
                      contradiction=_cut(reading.contradiction, MAX_TEXT))
    b = schema.bmc_syncs
    tx.execute(sa.update(b).where(b.c.machine_id == machine_id).values(**values))
    _note_changes(tx, before, reading, answered)
    return before


def _note_changes(tx: Tx, before: BmcSync, reading: Reading, answered: bool) -> None:
    if before.status != reading.status:
        why = f": {reading.problem}" if reading.problem else ""
        history.record(tx, before.machine_id, Topic.BMC, Event.STATUS,
                       _cut(f"{reading.status} (was {before.status}){why}", MAX_TEXT))
    if answered and reading.contradiction and not before.contradiction:
        history.record(tx, before.machine_id, Topic.BMC, Event.CONTRADICTS,
                       _cut(reading.contradiction, MAX_TEXT))


def of_machine(tx: Tx, machine_id: uuid.UUID) -> BmcSync | None:
    return of_machines(tx, [machine_id]).get(machine_id)


def of_machines(tx: Tx, machine_ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, BmcSync]:
    """The book's row of each machine in it (a page's worth of ids)."""
    ids = list(machine_ids)
    if not ids:
        return {}
    b = schema.bmc_syncs
    rows = tx.execute(sa.select(b).where(b.c.machine_id.in_(ids)))
    return {row.machine_id: BmcSync(**row._mapping) for row in rows}


@dataclass(frozen=True)
class BmcSyncCounts:
    """The fleet's BMCs that are not ``answering``, by status, and its contradictions,
    for ``/metrics``: read through partial indexes of those rows alone, so a scrape
    costs what is wrong, never the fleet's size."""

    by_status: dict[str, int]
    contradictions: int


def counts(tx: Tx) -> BmcSyncCounts:
    b = schema.bmc_syncs
    by_status = {status: 0 for status in STATUSES if status != ANSWERING}
    by_status.update({row.status: row.n for row in tx.execute(
        sa.select(b.c.status, sa.func.count().label("n"))
        .where(b.c.status != ANSWERING).group_by(b.c.status))})
    contradictions = tx.execute(sa.select(sa.func.count()).select_from(b)
                                .where(b.c.contradiction.is_not(None))).scalar_one()
    return BmcSyncCounts(by_status, contradictions)


def _cut(text: str | None, limit: int) -> str | None:
    return None if text is None else text[:limit]
