"""Sourcing: claim a batch of a process's backlog and hand each claim to a dispatcher.

The rules, in one place (the Celery task ``shepherd.source`` is glue over them):

* at most ``batch_size`` claims per run, and never more than ``in_flight_cap`` work
  items of the process fleet-wide (unadopted claims included): for installations,
  the fleet-wide cap of installations in flight (``SHEPHERD_INSTALL_IN_FLIGHT_CAP``);
* one sourcing per process at a time fleet-wide (a ``bmdb.singletons`` hold), so the
  caps are exact even when beats pile up or an operator sources by hand;
* Recovery is claimed through ``recovery_claims.claim_recovery``: under its hold,
  after the blast-radius guard, and within the hourly reboot budget;
* each claim carries a dispatch deadline (``dispatch_ttl``): a claim nobody adopts in
  time is released by the sweep;
* a run that finds nothing to claim (one read: no eligible machine in the backlog)
  ends there, before the hold, the guard and the claim: with beat sourcing every few
  seconds, empty runs are most runs, and each would otherwise cost four transactions
  (and for Recovery the guard's HTTP call) for nothing;
* claims are dispatched after the hold is released (dispatching is an outside effect:
  a broker call); once the dispatcher refuses one, the rest of the batch is cancelled
  at once instead of waiting for the sweep, since the broker is most likely down and
  trying each would cost a connection timeout apiece while the machines stay held.

Why a dispatch callback: the workflow does not know Celery; the task passes a
function that sends the per-machine message (``apply_async``), a test passes a list's
``append``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import bmdb
from shepherd.workflows.guard import GuardDecision, GuardLimits
from shepherd.workflows.recovery_claims import ClaimsBusy, RecoveryPaused, claim_recovery

log = logging.getLogger(__name__)
Dispatch = Callable[[bmdb.Work], None]
#: The processes sourcing claims for (each has a per-machine task).
SOURCED = (bmdb.Process.AGENT_START, bmdb.Process.RECOVERY, bmdb.Process.OS_INSTALL)
SKIPPED = "sourcing already running"


@dataclass(frozen=True)
class SourcingSettings:
    batch_size: int = 20
    in_flight_cap: int = 100
    dispatch_ttl: float = 120.0


def source(session: bmdb.Session, process: bmdb.Process, settings: SourcingSettings,
           limits: GuardLimits, dispatch: Dispatch,
           on_decision: Callable[[GuardDecision], None] | None = None) -> dict[str, Any]:
    """Claim and dispatch one batch of ``process``'s backlog; what happened, as JSON.

    ``limits`` are the guard's (Recovery only); ``on_decision`` sees each guard
    decision (metrics count pauses). The answer is one of::

        {"process", "skipped"}                       another sourcing holds the process
        {"process", "paused", "guard"}               the guard pauses Recovery
        {"process", "claimed": 0, "active", "more"}  the in-flight cap is reached
        {"process", "claimed", "dispatched", "refused", "active", "more"}

    (the last with 0 claimed and the guard not asked when nothing was eligible).
    ``more`` says to source again at once (``more_to_source``) rather than at the
    next beat.
    """
    if process not in SOURCED:
        raise ValueError(f"no sourcing for process {process.value!r}")
    active, claimable = session.db.read(lambda tx: _outlook(tx, process, session.db))
    if not claimable:
        return {"process": process.value, "claimed": 0, "dispatched": 0, "refused": 0,
                "active": active, "more": False}
    capped = False

    def claim(budget: int) -> list[bmdb.Work]:
        nonlocal active, capped
        active = session.transact(lambda tx: bmdb.active_work(tx, process))
        limit = min(budget, settings.in_flight_cap - active)
        capped = limit <= 0
        if capped:
            return []
        return session.claim_backlog(process, limit, dispatch_ttl=settings.dispatch_ttl)

    if process is bmdb.Process.RECOVERY:
        try:
            claims = claim_recovery(session, session.db.thresholds, limits,
                                    lambda allowed: claim(min(settings.batch_size, allowed)),
                                    on_decision=on_decision)
        except ClaimsBusy:
            return {"process": process.value, "skipped": SKIPPED}
        except RecoveryPaused as paused:
            log.error("RECOVERY PAUSED: %s", paused.decision.paused)
            return {"process": process.value, "paused": paused.decision.paused,
                    "guard": paused.decision.to_json()}
    else:
        with bmdb.hold_singleton(session, f"source:{process.value}") as held:
            if not held:
                return {"process": process.value, "skipped": SKIPPED}
            claims = claim(settings.batch_size)
    if capped:
        return {"process": process.value, "claimed": 0, "active": active, "more": False}
    refused = dispatch_all(claims, dispatch)
    if claims:
        log.info("sourced %d %s claims (%d refused by the broker)", len(claims),
                 process.value, refused)
    return {"process": process.value, "claimed": len(claims),
            "dispatched": len(claims) - refused, "refused": refused, "active": active,
            "more": more_to_source(len(claims), refused, active, settings)}


def more_to_source(claimed: int, refused: int, active: int,
                   settings: SourcingSettings) -> bool:
    """Whether the backlog likely holds more than this run took, and may be handed out.

    Why not wait for the next beat: one batch per beat (20 every 5 s by default) is 4
    machines a second, and a rack coming up at once, or a fleet taken over, would
    wait hours behind it. A full batch says more is waiting, so the run is followed
    at once by another, as long as the in-flight cap has room (the cap, not the beat,
    is what bounds how much is handed out) and the broker took every claim (one that
    refuses waits for the beat). A batch the guard or the cap cut short, or the
    backlog ended, is not full: the beat picks up from there.
    """
    return (claimed == settings.batch_size and refused == 0
            and active + claimed < settings.in_flight_cap)


def _outlook(tx: bmdb.Tx, process: bmdb.Process, db: bmdb.BMDB) -> tuple[int, bool]:
    """The process's work in flight, and whether its backlog has a machine to claim.
    Read outside the session: a session's transaction locks its session row, which
    makes its COMMIT wait for the WAL on disk, for a read that needs no lease."""
    backlog = bmdb.retriever(process, db.thresholds)
    return (bmdb.active_work(tx, process),
            bmdb.any_claimable(tx, process, backlog))


def dispatch_all(claims: list[bmdb.Work], dispatch: Dispatch) -> int:
    """Dispatch each claim; after the first refusal cancel the rest. Returns how many
    were refused (cancelled, or left to the sweep when even the cancel failed)."""
    refused = 0
    refusal: str | None = None
    for work in claims:
        if refusal is None:
            try:
                dispatch(work)
                continue
            except Exception as error:  # the broker refused: release the claim at once
                refusal = f"broker refused: {type(error).__name__}: {error}"
                log.error("%s (%s for machine %s); cancelling the rest of the batch",
                          refusal, work.process.value, work.machine_id)
        refused += 1
        try:
            work.cancel(refusal)
        except Exception as error:  # keep cancelling the rest; the sweep gets this one
            log.error("cancelling the refused claim %s failed: %s", work.id, error)
    return refused
