"""Holds (maintenance, quarantine, host-key and BMC mismatches): machines Shepherd
leaves alone, and why.

A hold is a row of ``machine_holds`` (machine, kind, reason, who, since). Any hold
takes the machine out of every backlog (``backlog.not_held``) and out of the
guard's silent share (``fleet``): nothing automatic touches it. Every change is in
history with who and why.

* ``maintenance``: put and lifted by an operator (``shepherd maintenance on|off``).
* ``quarantine``: put by Recovery when the reboot ladder was exhausted
  ``limit`` times in a row, or by the installation workflow when installations failed
  ``limit`` times in a row (``quarantine_if_due``, its ``Streak``); lifted only by an
  operator (``shepherd quarantine clear``): a machine no reboot or reinstallation
  brings back needs hands.
* ``host-key``: put by AgentStart or Recovery when a takeover met another SSH host
  key than the machine's pin (``shepherd.workflows.initializer.hold_on_mismatch``),
  with the key it met; lifted by an operator who accepts that key (``shepherd
  host-key accept``, which pins it) or lifts the hold after fixing the pin.
* ``bmc-mismatch``: put before a BMC action when the BMC manages another system than
  the machine (``shepherd.power.mismatch``); lifted by an operator who fixed the
  inventory (``shepherd bmc-mismatch clear``). The next BMC action checks again.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass
from typing import NamedTuple

import sqlalchemy as sa

from bmdb import _schema as schema
from bmdb import history
from bmdb._database import Tx
from bmdb.vocabulary import (
    BMC_MISMATCH_HOLD,
    HOST_KEY_HOLD,
    LADDER_EXHAUSTED,
    MAINTENANCE,
    QUARANTINE,
    Event,
    HoldKind,
    Process,
    Topic,
)

_TOPIC = {MAINTENANCE: Topic.MAINTENANCE, QUARANTINE: Topic.QUARANTINE,
          HOST_KEY_HOLD: Topic.HOST_KEY, BMC_MISMATCH_HOLD: Topic.BMC_MISMATCH}
MAX_REASON = 500


@dataclass(frozen=True)
class Hold:
    machine_id: uuid.UUID
    kind: HoldKind
    reason: str
    actor: str
    since: dt.datetime
    #: A ``host-key`` hold's: the key line the machine presented.
    host_key: str | None = None


def put(tx: Tx, machine_id: uuid.UUID, kind: HoldKind, reason: str, actor: str,
        host_key: str | None = None) -> bool:
    """Hold the machine (``kind``); False, changing nothing, if it already is so held."""
    h = schema.machine_holds
    if holds_of(tx, machine_id, kind):
        return False
    reason, actor = reason.strip()[:MAX_REASON], actor.strip()[:128]
    tx.execute(sa.insert(h).values(machine_id=machine_id, kind=kind, reason=reason,
                                   actor=actor, since=tx.now, host_key=host_key))
    history.record(tx, machine_id, _TOPIC[kind], Event.HELD, f"by {actor}: {reason}")
    return True


def lift(tx: Tx, machine_id: uuid.UUID, kind: HoldKind, actor: str, reason: str = "") -> bool:
    """Lift the hold; False if there was none."""
    h = schema.machine_holds
    deleted = tx.execute(sa.delete(h).where(h.c.machine_id == machine_id, h.c.kind == kind))
    if deleted.rowcount != 1:
        return False
    why = f"by {actor.strip()[:128]}" + (f": {reason.strip()[:MAX_REASON]}" if reason else "")
    history.record(tx, machine_id, _TOPIC[kind], Event.RELEASED, why)
    return True


def holds_of(tx: Tx, machine_id: uuid.UUID, kind: HoldKind | None = None) -> list[Hold]:
    """The machine's holds (of ``kind`` only, if given), oldest first."""
    h = schema.machine_holds
    query = sa.select(h).where(h.c.machine_id == machine_id).order_by(h.c.since)
    if kind is not None:
        query = query.where(h.c.kind == kind)
    return [Hold(row.machine_id, row.kind, row.reason, row.actor, row.since, row.host_key)
            for row in tx.execute(query)]


class Streak(NamedTuple):
    """Which failures in a row quarantine a machine: of ``process``, those whose cause
    starts with ``cause_prefix`` (any cause when empty); ``what`` names them in the hold's
    reason."""

    process: Process
    cause_prefix: str
    what: str


#: Recovery's: reboot ladders climbed to their end without a verified rung.
LADDERS_EXHAUSTED = Streak(Process.RECOVERY, LADDER_EXHAUSTED, "the reboot ladder was exhausted")
#: The installation workflow's: installations that failed (a cancel is no failure).
INSTALLATIONS_FAILED = Streak(Process.OS_INSTALL, "", "an installation failed")


def failures_in_a_row(tx: Tx, machine_id: uuid.UUID, limit: int,
                      streak: Streak = LADDERS_EXHAUSTED) -> int:
    """How many of the machine's latest outcomes of ``streak.process`` (up to ``limit``)
    were failures it counts, counted back from the newest until another outcome, or
    until an operator last let the machine out of quarantine (a fresh start: the
    failures before it were looked at by a person).

    Reads at most ``limit`` rows through the (machine_id, id) history index.
    """
    h = schema.history
    outcome = sa.and_(h.c.process == streak.process.value,
                      h.c.event.in_(("Finished", "Failed")))
    released = sa.and_(h.c.process == Topic.QUARANTINE, h.c.event == Event.RELEASED)
    rows = tx.execute(
        sa.select(h.c.event, h.c.cause)
        .where(h.c.machine_id == machine_id, sa.or_(outcome, released))
        .order_by(h.c.id.desc()).limit(limit)
    )
    count = 0
    for event, cause in rows:
        if event != "Failed" or not (cause or "").startswith(streak.cause_prefix):
            break
        count += 1
    return count


def quarantine_if_due(tx: Tx, machine_id: uuid.UUID, limit: int, actor: str,
                      streak: Streak = LADDERS_EXHAUSTED) -> bool:
    """Quarantine the machine once ``streak``'s failures came ``limit`` times in a row
    (this failure included: call it after recording the failure); True if it was."""
    count = failures_in_a_row(tx, machine_id, limit, streak)
    if count < limit:
        return False
    return put(tx, machine_id, QUARANTINE, f"{streak.what} {count} times in a row", actor)
