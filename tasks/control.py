"""Control tasks (queue ``shepherd.control``): reconcile, update, source, sweep, and
pruning history.

Beat schedules all of them; each can also be called by hand. They are short and
never touch a machine over SSH themselves: sourcing hands machines to per-machine
tasks (``tasks.machines``) on their own queue.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import bmdb
from celeryconfig import MACHINE_QUEUES, periodic_expiry
from shepherd import runtime, task_api
from shepherd.workflows import guard, retention, sourcing
from tasks.celery_app import app
from tasks.errors import ReconcileRefused, ShepherdTaskError
from tasks.machines import count_pauses

log = logging.getLogger(__name__)


@task_api.RECONCILE.implement(app, throws=(ShepherdTaskError,))
def reconcile(wait_for_running: float = task_api.BY_HAND_RECONCILE_WAIT) -> dict[str, Any]:
    """Bring provider machines into the BMDB and create more (the rules, the fleet-wide
    hold among them: ``shepherd.workflows.provisioner``)."""
    from shepherd.workflows.provisioner import FleetMismatch
    from shepherd.workflows.provisioner import reconcile as run_reconcile

    rt = app.runtime
    try:
        result = run_reconcile(rt.session, rt.provider, runtime.provisioner_settings(rt.settings),
                               wait_for_running=wait_for_running)
    except FleetMismatch as error:
        raise ReconcileRefused(str(error)) from None
    return result.to_json()


@task_api.UPDATE.implement(app, throws=(ShepherdTaskError,))
def update() -> dict[str, Any]:
    """Refresh every Provided tag (provider status, address...) from one listing."""
    from shepherd.workflows.updater import update as run_update

    rt = app.runtime
    return run_update(rt.session, rt.provider, runtime.updater_settings(rt.settings)).to_json()


@task_api.SWEEP.implement(app)
def sweep() -> dict[str, Any]:
    """Release work of dead sessions and claims nobody adopted in time."""
    result = app.runtime.db.sweep()
    if result.abandoned or result.unadopted:
        log.warning("sweep released %d abandoned and %d unadopted claims",
                    result.abandoned, result.unadopted)
    return dataclasses.asdict(result)


@task_api.PRUNE_HISTORY.implement(app)
def prune_history() -> dict[str, Any]:
    """Delete history older than SHEPHERD_HISTORY_RETENTION days, a bounded share per
    run in short transactions (the rules: ``shepherd.workflows.retention``)."""
    rt = app.runtime
    result = retention.prune(rt.db, runtime.retention_settings(rt.settings))
    if result.deleted:
        log.info("pruned %d history rows older than %s", result.deleted, result.cutoff)
    return result.to_json()


@task_api.RECOVERY_GUARD.implement(app)
def recovery_guard_status() -> dict[str, Any]:
    """What the blast-radius guard says now (for operators: ``celery -A tasks call``)."""
    rt = app.runtime
    return guard.evaluate(rt.db, rt.settings.thresholds, rt.guard_limits()).to_json()


@task_api.SOURCE.implement(app, throws=(ShepherdTaskError,))
def source(process: str) -> dict[str, Any]:
    """Claim a batch of ``process``'s backlog and dispatch one per-machine task per claim
    (the rules: ``shepherd.workflows.sourcing``).

    Each message expires with its claim's dispatch deadline: a message nobody took
    before the sweep released the claim would only end as "gone" anyway. Its result is
    not stored: the outcome is the BMDB's (history, backoffs), nobody holds the task
    id to ask for it, and Flower has it from the worker's events; a result per
    machine would cost the worker two Redis writes and Redis its memory for a day.
    When sourcing says there is more, the next sourcing is sent at once.
    """
    chosen = bmdb.Process(process)
    task = task_api.MACHINE_TASKS.get(chosen)
    if task is None:
        raise ValueError(f"no per-machine task for process {process!r}")
    rt = app.runtime
    settings = runtime.sourcing_settings(rt.settings, chosen)

    def dispatch(work: bmdb.Work) -> None:
        task.bind(str(work.machine_id), str(work.id)).send(
            app, expires=settings.dispatch_ttl, queue=MACHINE_QUEUES[task.name],
            ignore_result=True)

    result = sourcing.source(rt.session, chosen, settings, rt.guard_limits(), dispatch,
                             on_decision=count_pauses)
    if result.get("more"):
        task_api.SOURCE.bind(process).send(
            app, expires=periodic_expiry(rt.settings.source_interval))
    return result
