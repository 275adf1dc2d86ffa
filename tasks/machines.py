"""Per-machine tasks: ``shepherd.agent_start`` and ``shepherd.recovery``.

Each takes ``(machine_id, work_id=None)`` as strings. With a ``work_id`` (dispatched
by sourcing) it adopts that claim into this process's BMDB session; a claim that is
gone (adopted already: a redelivered message; or released: dispatched too late)
ends the task as SUCCESS ``{"outcome": "gone"}`` without touching the machine.
Without one (called by hand) it claims the machine itself under the same rules and
fails with the BMDB's reason when the machine is busy, backing off or not due.

The workflow finishes or fails the work itself; a failure (already in the BMDB with
its backoff) is then raised as ``MachineWorkFailed`` so the task is FAILURE in Flower.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

import bmdb
from shepherd import metrics, runtime, task_api
from shepherd.workflows import WorkflowResult, guard, initialize, recover, recovery_claims
from shepherd.workflows.common import NOT_OURS, fail
from tasks.celery_app import app
from tasks.errors import (
    MachineNotClaimable,
    MachineWorkFailed,
    MachineWorkLost,
    RecoveryPaused,
    ShepherdTaskError,
)

log = logging.getLogger(__name__)
Workflow = Callable[[bmdb.Work], WorkflowResult]


def gone(process: bmdb.Process, machine_id: str, work_id: str, why: str) -> dict[str, Any]:
    log.info("%s on %s: claim %s is gone (%s); nothing done", process.value, machine_id,
             work_id, why)
    return {"machine_id": machine_id, "process": process.value, "work_id": work_id,
            "outcome": "gone", "cause": why}


def adopt(process: bmdb.Process, machine_id: str, work_id: str) -> bmdb.Work | None:
    """The dispatched claim, now ours; None when it is gone."""
    try:
        return app.runtime.session.adopt(uuid.UUID(work_id), machine_id=uuid.UUID(machine_id),
                                   process=process)
    except bmdb.WorkGone:
        return None


def claim(process: bmdb.Process, machine_id: str) -> bmdb.Work:
    """Claim one named machine (a call by hand), or say why not, touching nothing."""
    try:
        return app.runtime.session.claim_machine(process, uuid.UUID(machine_id))
    except bmdb.NotClaimable as error:
        raise MachineNotClaimable(str(error)) from None


def run(process: bmdb.Process, work: bmdb.Work, workflow: Workflow) -> dict[str, Any]:
    """Run the workflow on ``work`` (failures use the configured backoff) and report.

    The workflow finishes or fails the work itself once it runs; what it needs first
    (the provider, built on first use, and its settings) can fail before that, and
    the claim must not stay held by this live session: it is failed here.
    """
    configured = runtime.configured(work, app.runtime.settings)
    try:
        result = workflow(configured)
    except NOT_OURS as error:
        raise lost(process, work, error) from None
    except Exception as error:
        log.exception("%s on %s: could not start the workflow", process.value,
                      work.machine_id)
        try:
            result = fail(configured, f"worker: {type(error).__name__}: {error}")
        except NOT_OURS as lost_meanwhile:
            raise lost(process, work, lost_meanwhile) from None
    if not result.ok:
        raise MachineWorkFailed(f"{process.value} failed on machine {work.machine_id}: "
                                f"{result.cause} (backoff {result.backoff_seconds}s)")
    return result.to_json() | {"work_id": str(work.id)}


def lost(process: bmdb.Process, work: bmdb.Work, error: Exception) -> MachineWorkLost:
    return MachineWorkLost(f"{process.value} on machine {work.machine_id}: the claim was "
                           f"lost mid-way ({type(error).__name__}: {error}); the sweep "
                           "releases it")


def _initialize(work: bmdb.Work) -> WorkflowResult:
    rt = app.runtime
    return initialize(work, rt.provider, runtime.initializer_settings(rt.settings))


def _recover(work: bmdb.Work) -> WorkflowResult:
    rt = app.runtime
    return recover(work, rt.provider, rt.power_for, runtime.recoverer_settings(rt.settings))


def count_pauses(decision: guard.GuardDecision) -> None:
    """Each guard decision's pause reasons, counted where it is taken (worker metrics)."""
    metrics.count_recovery_pause(decision.causes)


def paused_at_execution(work: bmdb.Work) -> str | None:
    """Why Recovery must not reboot the adopted machine now, or None.

    Asked right before the reboot: the callback server may have failed since the
    claim was sourced. A guard that cannot decide (its BMDB read failed) pauses too:
    a reboot is the one action here that cannot be taken back.
    """
    rt = app.runtime
    try:
        decision = guard.evaluate(rt.db, rt.settings.thresholds, rt.guard_limits(),
                                  budget=False)
    except Exception as error:
        log.exception("recovery guard failed before rebooting %s", work.machine_id)
        return (f"{guard.PAUSED_PREFIX}the guard could not decide: "
                f"{type(error).__name__}: {error}")
    count_pauses(decision)
    return decision.paused


@task_api.AGENT_START.implement(app, throws=(ShepherdTaskError,))
def agent_start(machine_id: str, work_id: str | None = None) -> dict[str, Any]:
    """Start the agent on one machine (AgentStart)."""
    process = bmdb.Process.AGENT_START
    if work_id is None:
        return run(process, claim(process, machine_id), _initialize)
    work = adopt(process, machine_id, work_id)
    if work is None:
        return gone(process, machine_id, work_id, "already adopted or released")
    return run(process, work, _initialize)


@task_api.RECOVERY.implement(app, throws=(ShepherdTaskError,))
def recovery(machine_id: str, work_id: str | None = None) -> dict[str, Any]:
    """Reboot one silent machine and send it back to AgentStart (Recovery).

    The blast-radius guard is asked again here, right before the reboot: the callback
    server may have failed since the claim was sourced.
    """
    process = bmdb.Process.RECOVERY
    if work_id is None:
        work = claim_by_hand_under_guard(machine_id)
    else:
        adopted = adopt(process, machine_id, work_id)
        if adopted is None:
            return gone(process, machine_id, work_id, "already adopted or released")
        work = adopted
        paused = paused_at_execution(work)
        if paused is not None:
            log.error("RECOVERY PAUSED, not rebooting %s: %s", machine_id, paused)
            work.cancel(paused)
            return {"machine_id": machine_id, "process": process.value, "work_id": work_id,
                    "outcome": "paused", "cause": paused}
    return run(process, work, _recover)


def claim_by_hand_under_guard(machine_id: str, wait: float = 10.0) -> bmdb.Work:
    """Claim for a manual Recovery call: guard (budget included) first, then the claim,
    under the same fleet-wide hold as sourcing (``recovery_claims``), so the hourly
    budget stays exact."""
    rt = app.runtime
    try:
        [work] = recovery_claims.claim_recovery(
            rt.session, rt.settings.thresholds, rt.guard_limits(),
            lambda allowed: [claim(bmdb.Process.RECOVERY, machine_id)],
            wait=wait, on_decision=count_pauses)
    except recovery_claims.RecoveryPaused as paused:
        log.error("RECOVERY PAUSED, refusing the manual call on %s: %s", machine_id, paused)
        raise RecoveryPaused(f"machine {machine_id} not rebooted: {paused}") from None
    except recovery_claims.ClaimsBusy as busy:
        raise MachineNotClaimable(f"machine {machine_id}: {busy}") from None
    return work

