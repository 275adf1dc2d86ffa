"""The last power state Shepherd observed of each machine, and the last power action it
asked for: one row per machine in ``power_states``.

Why in the BMDB: the web view's pages must stay flat at a million machines and must
never call a BMC or a provider while rendering, yet operators want a machine's power.
So whoever talks to a power control (Recovery's reboot ladder, ``shepherd power``)
records what it saw and what it asked, with the BMDB's clock, and pages read it back
(``of_machines``: one primary-key probe per machine of a page). A reading is history,
not the present: callers show it with its age.

Only readings that say something are recorded (On, Off, Transitioning); a failed or
unknown reading leaves the last known one in place.

An action is recorded **before** the call, as asked (``record_asked``, with a history
row), and again once the call returned, as acknowledged or failed (``record_action``).
Invariant: no power action is sent without its intent committed first
(``shepherd.power.recorded``), so a worker killed mid-call still leaves the reset in
history and in ``shepherd show``, and the next attempt can see it
(``PowerObservation.may_be_under_way``).
An acknowledgement is not proof it happened either (``shepherd.power.base``).
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

import sqlalchemy as sa

from bmdb import _schema as schema
from bmdb import history, tags
from bmdb._database import Tx
from bmdb.vocabulary import Event, Topic

#: The states worth recording (``shepherd.power.PowerState`` values but Unknown).
KNOWN_STATES = frozenset({"On", "Off", "Transitioning"})
MAX_VIA = 256
MAX_ACTION = 32
ASKED, ACKNOWLEDGED, FAILED = "asked", "acknowledged", "failed"


@dataclass(frozen=True)
class PowerObservation:
    #: "On", "Off" or "Transitioning"; None when only an action was recorded.
    state: str | None
    observed_at: dt.datetime | None
    #: The last action asked ("power_off", "force_restart", ...), or None.
    action: str | None
    acted_at: dt.datetime | None
    #: The power control asked (a BMC's or a provider's description).
    via: str
    #: What became of ``action``: "asked" (the call had not returned, or its worker
    #: died), "acknowledged" or "failed"; None for an action recorded before intents.
    outcome: str | None = None

    def may_be_under_way(self, since: dt.datetime) -> bool:
        """Whether ``action`` was asked after ``since`` and may have happened (asked or
        acknowledged, not failed)."""
        return (self.action is not None and self.acted_at is not None
                and self.acted_at > since and self.outcome != FAILED)


def record_observed(tx: Tx, machine_id: uuid.UUID, state: str, via: str) -> bool:
    """Record ``state`` as seen now through ``via``; False (nothing written) for a state
    that says nothing (``Unknown``) or a machine the BMDB no longer has."""
    if state not in KNOWN_STATES or not _exists(tx, machine_id):
        return False
    tags.upsert(tx, schema.power_states, {"machine_id": machine_id},
                {"state": state, "observed_at": tx.now, "via": via[:MAX_VIA]})
    return True


def record_asked(tx: Tx, machine_id: uuid.UUID, action: str, via: str) -> bool:
    """Record, before the call, that ``action`` is being asked of ``via`` now, in the
    power state and in history; False for a machine the BMDB no longer has."""
    if not record_action(tx, machine_id, action, via, ASKED):
        return False
    history.record(tx, machine_id, Topic.POWER, Event.ASKED,
                   f"{action[:MAX_ACTION]} of {via[:MAX_VIA]}")
    return True


def record_action(tx: Tx, machine_id: uuid.UUID, action: str, via: str,
                  outcome: str = ACKNOWLEDGED) -> bool:
    """Record ``action`` of ``via`` now, with its ``outcome``; False for a machine the
    BMDB no longer has."""
    if not _exists(tx, machine_id):
        return False
    tags.upsert(tx, schema.power_states, {"machine_id": machine_id},
                {"action": action[:MAX_ACTION], "acted_at": tx.now, "via": via[:MAX_VIA],
                 "action_outcome": outcome})
    return True


def of_machine(tx: Tx, machine_id: uuid.UUID) -> PowerObservation | None:
    return of_machines(tx, [machine_id]).get(machine_id)


def of_machines(tx: Tx, machine_ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, PowerObservation]:
    """The recorded power of each machine that has any (a page's worth of ids)."""
    ids = list(machine_ids)
    if not ids:
        return {}
    p = schema.power_states
    rows = tx.execute(sa.select(p).where(p.c.machine_id.in_(ids)))
    return {row.machine_id: observation(row) for row in rows}


def observation(row: sa.Row[object] | sa.RowMapping) -> PowerObservation:
    """A ``power_states`` row (or a row carrying its columns) as a record."""
    values = row._mapping if isinstance(row, sa.Row) else row
    return PowerObservation(state=values["state"], observed_at=values["observed_at"],
                            action=values["action"], acted_at=values["acted_at"],
                            via=values["via"], outcome=values["action_outcome"])


def _exists(tx: Tx, machine_id: uuid.UUID) -> bool:
    m = schema.machines
    return tx.execute(sa.select(m.c.id).where(m.c.id == machine_id)).first() is not None
