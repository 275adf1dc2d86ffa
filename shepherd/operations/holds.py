"""Operators' holds: put a machine into maintenance, take it out, clear a quarantine or a
BMC mismatch.

A hold takes the machine out of every backlog (``bmdb.holds``), so nothing automatic
touches it; it does not stop work that already holds the machine, which is why each
change reports that work (the operator then knows to wait for it). Every change is
one transaction, with its history row saying who and why.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import bmdb
from bmdb import MAINTENANCE, QUARANTINE, BackoffInfo, Hold, HoldKind, WorkInfo
from shepherd.operations.arguments import BadArgument
from shepherd.operations.reads import require_machine


@dataclass(frozen=True)
class HoldChange:
    """What a hold command did. ``hold``: the hold put, lifted, or already there (for an
    ``on`` that changed nothing); ``remaining``: holds still keeping the machine out;
    ``work``: work holding the machine now (a hold does not stop it); ``backoff``: the
    active Recovery backoff a lifted machine still sits out."""

    machine: uuid.UUID
    kind: HoldKind
    action: str
    changed: bool
    hold: Hold | None
    remaining: list[Hold] = field(default_factory=list)
    work: list[WorkInfo] = field(default_factory=list)
    backoff: BackoffInfo | None = None


def put_maintenance(session: bmdb.Session, machine_id: uuid.UUID, reason: str,
                    actor: str) -> HoldChange:
    """Put the machine into maintenance; ``changed`` False if it already was."""
    reason = require_text(reason, "--reason", "say why (it is shown to everyone and kept "
                                              "in history)")
    actor = require_text(actor, "--by", "name who does this")

    def body(tx: bmdb.Tx) -> HoldChange:
        require_machine(tx, machine_id)
        changed = bmdb.put_hold(tx, machine_id, MAINTENANCE, reason, actor)
        (hold,) = bmdb.holds_of(tx, machine_id, MAINTENANCE)
        return HoldChange(machine_id, MAINTENANCE, "on", changed, hold,
                          bmdb.holds_of(tx, machine_id),
                          bmdb.machine_work(tx, machine_id))

    return session.transact(body)


def lift_maintenance(session: bmdb.Session, machine_id: uuid.UUID, actor: str,
                     reason: str = "") -> HoldChange:
    """Take the machine out of maintenance; ``changed`` False if it was not in it."""
    return _lift(session, machine_id, MAINTENANCE, "off", actor, reason)


def clear_quarantine(session: bmdb.Session, machine_id: uuid.UUID, actor: str,
                     reason: str = "") -> HoldChange:
    """Let a quarantined machine back; ``changed`` False if it was not quarantined."""
    return _lift(session, machine_id, QUARANTINE, "clear", actor, reason)


def clear_bmc_mismatch(session: bmdb.Session, machine_id: uuid.UUID, actor: str,
                       reason: str) -> HoldChange:
    """Let a machine held on a BMC mismatch back, once the inventory is fixed (the next
    BMC action checks the identities again); ``--reason`` is required: history must
    say what was wrong."""
    reason = require_text(reason, "--reason", "say what was fixed (kept in history)")
    return _lift(session, machine_id, bmdb.BMC_MISMATCH_HOLD, "clear", actor, reason)


def _lift(session: bmdb.Session, machine_id: uuid.UUID, kind: HoldKind, action: str,
          actor: str, reason: str) -> HoldChange:
    actor = require_text(actor, "--by", "name who does this")

    def body(tx: bmdb.Tx) -> HoldChange:
        require_machine(tx, machine_id)
        before = bmdb.holds_of(tx, machine_id, kind)
        changed = bmdb.lift_hold(tx, machine_id, kind, actor, reason)
        backoffs = bmdb.machine_backoffs(tx, machine_id, bmdb.Process.RECOVERY)
        active = next((b for b in backoffs if b.active), None)
        return HoldChange(machine_id, kind, action, changed, before[0] if before else None,
                          bmdb.holds_of(tx, machine_id),
                          bmdb.machine_work(tx, machine_id), active)

    return session.transact(body)


def require_text(value: str | None, option: str, why: str) -> str:
    """``value`` stripped; ``BadArgument`` naming ``option`` when it is blank."""
    text = (value or "").strip()
    if not text:
        raise BadArgument(f"{option} is required and must not be blank: {why}")
    return text
