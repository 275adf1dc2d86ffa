"""Starting a process on one named machine now: claim it, then hand it to a worker.

The claim is ``bmdb``'s own named claim made with a dispatch deadline, so a worker
can adopt it and the sweep releases it if nobody does; it is made by
``recovery_claims.claim_one``, as a per-machine task called by hand makes its own:
Recovery under the fleet-wide hold, after the guard. Only the wording of a refusal is
the operator's (``explain``).
"""

from __future__ import annotations

import time
import uuid

import bmdb
from shepherd.operations.explain import why_not
from shepherd.operations.reads import require_machine
from shepherd.workflows.guard import GuardLimits
from shepherd.workflows.recovery_claims import CLAIMS_WAIT, RecoveryPaused, claim_one

__all__ = ["CLAIMS_WAIT", "RecoveryPaused", "claim_for_handoff", "wait_adopted"]


def claim_for_handoff(session: bmdb.Session, process: bmdb.Process, machine_id: uuid.UUID,
                      dispatch_ttl: float, limits: GuardLimits | None = None) -> bmdb.Work:
    """Claim one named machine to hand to a worker within ``dispatch_ttl`` seconds, or
    raise why not: ``UnknownMachine``; ``MachineBusy`` / ``MachineInBackoff`` /
    ``NotInBacklog`` in ``explain``'s words; for Recovery ``RecoveryPaused`` when the
    guard (silent share, hourly budget and, when ``limits`` names it, the callback
    server's health) says no, or ``NotClaimable`` when another claimer keeps the
    Recovery hold for over ``CLAIMS_WAIT`` seconds.
    """
    session.transact(lambda tx: require_machine(tx, machine_id))
    try:
        return claim_one(session, process, machine_id, limits or GuardLimits(),
                         dispatch_ttl=dispatch_ttl)
    except (bmdb.MachineBusy, bmdb.MachineInBackoff, bmdb.NotInBacklog):
        raise why_not(session.db, process, machine_id) from None


def wait_adopted(session: bmdb.Session, work: bmdb.Work, timeout: float,
                 poll: float = 0.2) -> bool:
    """Wait until the claim leaves ``session`` (a worker adopted it, or it already ended);
    False after ``timeout``. Why wait: work of a closed session is released by the sweep
    as Abandoned, so the claimer must outlive the handoff."""
    deadline = time.monotonic() + timeout
    while True:
        holder = session.transact(lambda tx: bmdb.work_holder(tx, work.id))
        if holder != session.id:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)
