"""No BMC action on a machine whose BMC manages another system.

Checked before every change Recovery or ``shepherd power`` makes through a BMC
(``refuse_if_mismatched``): the machine must not hold a ``bmc-mismatch`` hold, and
the BMC's system must not be another than the machine's own DMI says
(``shepherd.power.identity``). A mismatch holds the machine, with both identities in
the reason, in a transaction of its own before ``BmcMismatch`` is raised: from then
on it is in no backlog, and ``shepherd power`` refuses it, until an operator fixes the
inventory and clears the hold; the next action checks again. Where a side names
nothing comparable, the check says so and lets the action go on: many small BMCs
report nothing useful, and guessing would hold healthy machines.
"""

from __future__ import annotations

import uuid

import bmdb
from shepherd.power import identity
from shepherd.power.base import PowerControl, PowerError, SystemIdentity

#: The history event a workflow notes the check's outcome under.
BMC_IDENTITY = "BmcIdentity"


class BmcMismatch(PowerError):
    """The machine is held, or has just been found, for a BMC managing another system."""


def refuse_if_mismatched(session: bmdb.Session, machine_id: uuid.UUID, power: PowerControl,
                         actor: str) -> identity.IdentityCheck:
    """The identity check's outcome (a match, or nothing to compare); ``BmcMismatch``,
    holding the machine, when its BMC manages another system. One BMC call (the
    identity read) unless the machine is held already; ``PowerError`` when the BMC
    cannot be read, as for any other call."""
    held = session.db.read(lambda tx: bmdb.holds_of(tx, machine_id, bmdb.BMC_MISMATCH_HOLD))
    if held:
        raise BmcMismatch(f"held on a BMC mismatch since {held[0].since:%Y-%m-%d %H:%M}: "
                          f"{held[0].reason}")
    return hold_if_mismatched(session, machine_id, power.identity(), power.description, actor)


def hold_if_mismatched(session: bmdb.Session, machine_id: uuid.UUID,
                       bmc: SystemIdentity, via: str,
                       actor: str) -> identity.IdentityCheck:
    """``bmc`` (read through ``via``) compared with the machine's own DMI: the outcome, or
    ``BmcMismatch`` once the machine is held. The power and health sync calls this with
    the identity its read brought, so a swapped pair is held before anyone acts."""
    report = session.db.read(lambda tx: bmdb.machine_tag(tx, "HardwareReport", machine_id))
    machine = identity.from_report(report["report"] if report else None)
    checked = identity.compare(bmc, machine)
    if not checked.mismatch:
        return checked
    reason = (f"{via}: {checked.reason} (BMC: {identity.describe(bmc)}; "
              f"machine: {identity.describe(machine)})")
    session.transact(lambda tx: bmdb.put_hold(tx, machine_id, bmdb.BMC_MISMATCH_HOLD,
                                              reason, actor))
    raise BmcMismatch(f"{reason}; held: no BMC action until the inventory is fixed and "
                      f"the hold cleared (shepherd bmc-mismatch clear {machine_id} "
                      f"--reason TEXT)")
