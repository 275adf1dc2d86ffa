"""Claiming Recovery: the one place it is done.

Invariant: Recovery is claimed only under the fleet-wide hold, after the guard, so
the hourly reboot budget is checked and spent by one claimer at a time.

Enforced here, by ``claim_recovery``, for every claimer (sourcing; and through
``claim_one``, a per-machine task called by hand and ``shepherd start recovery``):

1. take the hold ``RECOVERY_CLAIMS`` (``bmdb.singletons``: at most one holder
   fleet-wide, released at the end, or with the holder's session if it dies);
2. ask the blast-radius guard: the callback server first, outside any transaction,
   then ``guard.decide`` in one transaction of the holding session (which also
   re-checks that the session, and so the hold, is still alive);
3. claim at most ``decision.allowed`` machines, still under the hold.

Two claimers deciding at once would each see the same budget left and both spend
it; the hold makes "decide, then claim" one step fleet-wide. A claimer that does
not get the hold within ``wait`` gets ``ClaimsBusy`` and claims nothing.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import bmdb
from shepherd.workflows import guard
from shepherd.workflows.guard import GuardDecision, GuardLimits

#: The fleet-wide hold under which Recovery is claimed (sourcing's hold for Recovery).
RECOVERY_CLAIMS = "source:ShepherdRecovery"
#: How often a waiting claimer asks for the hold again (seconds).
POLL = 0.2
#: How long a claim of one named machine waits for another claimer's hold (seconds).
CLAIMS_WAIT = 10.0


class RecoveryPaused(Exception):
    """The blast-radius guard holds Recovery back; the message is ``decision.paused``."""

    def __init__(self, decision: GuardDecision) -> None:
        super().__init__(decision.paused)
        self.decision = decision


class ClaimsBusy(Exception):
    """Another claimer held the Recovery hold for longer than the caller would wait."""


def claim_recovery(session: bmdb.Session, thresholds: bmdb.Thresholds, limits: GuardLimits,
                   claim: Callable[[int], list[bmdb.Work]], *, budget: bool = True,
                   wait: float = 0.0,
                   on_decision: Callable[[GuardDecision], None] | None = None
                   ) -> list[bmdb.Work]:
    """Take the hold, ask the guard, and return ``claim(decision.allowed)``.

    ``claim`` makes the claims (a batch from the backlog, or one named machine) with
    ``session``, given how many the hourly budget still admits. ``on_decision`` sees
    every decision, paused or not (metrics count pauses). Raises ``ClaimsBusy`` when
    the hold stays taken for ``wait`` seconds (0: one try), ``RecoveryPaused`` when the
    guard says no; in both cases nothing is claimed. ``budget=False`` leaves the hourly
    budget out of the pause reasons (``claim`` still gets ``allowed``).
    """
    deadline = time.monotonic() + wait
    while True:
        with bmdb.hold_singleton(session, RECOVERY_CLAIMS) as held:
            if held:
                return _decide_and_claim(session, thresholds, limits, claim, budget,
                                         on_decision)
        if time.monotonic() >= deadline:
            raise ClaimsBusy(f"another claimer has held Recovery claims for over {wait:g}s; "
                             "try again in a few seconds")
        time.sleep(POLL)


def _decide_and_claim(session: bmdb.Session, thresholds: bmdb.Thresholds,
                      limits: GuardLimits, claim: Callable[[int], list[bmdb.Work]],
                      budget: bool,
                      on_decision: Callable[[GuardDecision], None] | None) -> list[bmdb.Work]:
    """Steps 2 and 3 of the module docstring; the caller holds ``RECOVERY_CLAIMS``."""
    callback = guard.check_callback(limits)  # HTTP: before the transaction, never in it
    decision = session.transact(
        lambda tx: guard.decide(tx, thresholds, limits, callback, budget=budget))
    if on_decision is not None:
        on_decision(decision)
    if decision.paused:
        raise RecoveryPaused(decision)
    return claim(decision.allowed)


def claim_one(session: bmdb.Session, process: bmdb.Process, machine_id: uuid.UUID,
              limits: GuardLimits, *, dispatch_ttl: float | None = None,
              wait: float = CLAIMS_WAIT,
              on_decision: Callable[[GuardDecision], None] | None = None) -> bmdb.Work:
    """Claim one named machine now (an operator's or a caller's choice, not the
    backlog's order), Recovery through ``claim_recovery`` like every Recovery claim.

    ``dispatch_ttl``: a claim for another session to adopt in time (``shepherd start``).
    Raises ``bmdb.NotClaimable`` (busy, in backoff, not in the backlog, or another
    claimer kept the Recovery hold for ``wait`` seconds) or ``RecoveryPaused``; either
    way nothing is claimed.
    """
    def claim(allowed: int = 1) -> list[bmdb.Work]:
        return [session.claim_machine(process, machine_id, dispatch_ttl=dispatch_ttl)]

    if process is not bmdb.Process.RECOVERY:
        return claim()[0]
    try:
        (work,) = claim_recovery(session, session.db.thresholds, limits, claim, wait=wait,
                                 on_decision=on_decision)
    except ClaimsBusy as busy:
        raise bmdb.NotClaimable(machine_id, process.value, str(busy)) from None
    return work
