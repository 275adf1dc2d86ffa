"""Control tasks (queue ``shepherd.control``): reconcile, update, source, sweep.

Beat schedules all of them; each can also be called by hand. They are short and
never touch a machine over SSH themselves: sourcing hands machines to per-machine
tasks (``tasks.machines``) on their own queue.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import sqlalchemy as sa

import bmdb
from shepherd import metrics, runtime
from shepherd.workflows import guard as recovery_guard
from tasks import app
from tasks.errors import ReconcileRefused, ShepherdTaskError
from tasks.machines import RECOVERY_CLAIMS, TASKS
from tasks.worker_state import STATE

log = logging.getLogger(__name__)
MACHINES_QUEUE = "shepherd.machines"


@app.task(name="shepherd.reconcile", throws=(ShepherdTaskError,))
def reconcile() -> dict[str, Any]:
    """Bring provider machines into the BMDB and create more; once at a time fleet-wide."""
    from shepherd.workflows.provisioner import FleetMismatch
    from shepherd.workflows.provisioner import reconcile as run_reconcile

    session = STATE.session
    with bmdb.singletons.hold(session, "reconcile") as held:
        if not held:
            log.info("reconcile already running elsewhere; skipped")
            return {"skipped": "reconcile already running"}
        try:
            result = run_reconcile(session, STATE.provider,
                                   runtime.provisioner_settings(STATE.settings))
        except FleetMismatch as error:
            raise ReconcileRefused(str(error)) from None
    return result.to_json()


@app.task(name="shepherd.update", throws=(ShepherdTaskError,))
def update() -> dict[str, Any]:
    """Refresh every Provided tag (provider status, address...) from one listing."""
    from shepherd.workflows.updater import update as run_update

    result = run_update(STATE.session, STATE.provider, runtime.updater_settings(STATE.settings))
    return result.to_json()


@app.task(name="shepherd.sweep")
def sweep() -> dict[str, Any]:
    """Release work of dead sessions and claims nobody adopted in time."""
    result = STATE.db.sweep()
    if result.abandoned or result.unadopted:
        log.warning("sweep released %d abandoned and %d unadopted claims",
                    result.abandoned, result.unadopted)
    return dataclasses.asdict(result)


@app.task(name="shepherd.recovery_guard")
def recovery_guard_status() -> dict[str, Any]:
    """What the blast-radius guard says now (for operators: ``celery -A tasks call``)."""
    settings = STATE.settings
    return recovery_guard.evaluate(STATE.db, settings.thresholds,
                                   runtime.guard_limits(settings)).to_json()


def active_work(tx: bmdb.Tx, process: bmdb.Process) -> int:
    """Work rows of ``process`` fleet-wide, unadopted claims included."""
    w = bmdb.schema.work
    query = sa.select(sa.func.count()).select_from(w).where(w.c.process == process.value)
    return int(tx.execute(query).scalar_one())


@app.task(name="shepherd.source", throws=(ShepherdTaskError,))
def source(process: str) -> dict[str, Any]:
    """Claim a batch of ``process``'s backlog and dispatch one per-machine task per claim.

    At most ``batch_size`` per run and never more than ``in_flight_cap`` work items of
    the process at once; Recovery also asks the blast-radius guard and stays within the
    hourly reboot budget. One sourcing per process at a time fleet-wide (a hold), so
    the caps are exact even when beats pile up or an operator calls it by hand.
    """
    chosen = bmdb.Process(process)
    task = TASKS.get(chosen)
    if task is None:
        raise ValueError(f"no per-machine task for process {process!r}")
    settings, session = STATE.settings, STATE.session
    hold = RECOVERY_CLAIMS if chosen is bmdb.Process.RECOVERY else f"source:{chosen.value}"
    with bmdb.singletons.hold(session, hold) as held:
        if not held:
            return {"process": chosen.value, "skipped": "sourcing already running"}
        budget = settings.batch_size
        if chosen is bmdb.Process.RECOVERY:
            decision = recovery_guard.evaluate(STATE.db, settings.thresholds,
                                               runtime.guard_limits(settings))
            metrics.count_recovery_pause(decision.causes)
            if decision.paused:
                log.error("RECOVERY PAUSED: %s", decision.paused)
                return {"process": chosen.value, "paused": decision.paused,
                        "guard": decision.to_json()}
            budget = min(budget, decision.allowed)
        active = session.transact(lambda tx: active_work(tx, chosen))
        limit = min(budget, settings.in_flight_cap - active)
        if limit <= 0:
            return {"process": chosen.value, "claimed": 0, "active": active}
        claims = session.claim_backlog(chosen, limit, dispatch_ttl=settings.dispatch_ttl)
    refused = 0
    refusal: str | None = None
    for work in claims:
        if refusal is None:
            try:
                task.apply_async(args=[str(work.machine_id), str(work.id)],
                                 expires=settings.dispatch_ttl, queue=MACHINES_QUEUE)
                continue
            except Exception as error:  # the broker refused: release the claim at once
                refusal = f"broker refused: {type(error).__name__}: {error}"
                log.error("%s (%s for machine %s); cancelling the rest of the batch",
                          refusal, task.name, work.machine_id)
        # After one refusal the broker is most likely down: trying each remaining claim
        # would cost a connection timeout apiece while the machines stay held.
        refused += 1
        try:
            work.cancel(refusal)
        except Exception as error:  # keep cancelling the rest; the sweep gets this one
            log.error("cancelling the refused claim %s failed: %s", work.id, error)
    if claims:
        log.info("sourced %d %s claims (%d refused by the broker)", len(claims),
                 chosen.value, refused)
    return {"process": chosen.value, "claimed": len(claims),
            "dispatched": len(claims) - refused, "refused": refused, "active": active}
