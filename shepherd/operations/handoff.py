"""Starting a process on one named machine now: claim it, then hand it to a worker.

The claim is ``bmdb``'s own named claim made with a dispatch deadline
(``Session.claim_machine(..., dispatch_ttl=)``), so a worker can adopt it and the
sweep releases it if nobody does. Recovery is claimed through
``recovery_claims.claim_recovery`` like every other Recovery claim: under the
fleet-wide hold, after the guard.
"""

from __future__ import annotations

import time
import uuid

import bmdb
from shepherd.operations.explain import why_not
from shepherd.operations.reads import require_machine
from shepherd.workflows.guard import GuardLimits
from shepherd.workflows.recovery_claims import ClaimsBusy, RecoveryPaused, claim_recovery

__all__ = ["CLAIMS_WAIT", "RecoveryPaused", "claim_for_handoff", "wait_adopted"]

#: How long an operator's Recovery claim waits for another claimer's hold (seconds).
CLAIMS_WAIT = 10.0


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

    def claim(allowed: int = 1) -> list[bmdb.Work]:
        return [session.claim_machine(process, machine_id, dispatch_ttl=dispatch_ttl)]

    try:
        if process is not bmdb.Process.RECOVERY:
            return claim()[0]
        try:
            (work,) = claim_recovery(session, session.db.thresholds, limits or GuardLimits(),
                                     claim, wait=CLAIMS_WAIT)
        except ClaimsBusy as error:
            raise bmdb.NotClaimable(machine_id, process.value, str(error)) from None
        return work
    except (bmdb.MachineBusy, bmdb.MachineInBackoff, bmdb.NotInBacklog):
        raise why_not(session.db, process, machine_id) from None


def wait_adopted(session: bmdb.Session, work: bmdb.Work, timeout: float,
                 poll: float = 0.2) -> bool:
    """Wait until the claim leaves ``session`` (a worker adopted it, or it already ended);
    False after ``timeout``. Why wait: work of a closed session is released by the sweep
    as Abandoned, so the claimer must outlive the handoff."""
    deadline = time.monotonic() + timeout
    while True:
        holder = session.transact(lambda tx: bmdb.queries.work_holder(tx, work.id))
        if holder != session.id:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)
