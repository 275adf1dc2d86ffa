"""Per-machine tasks: ``shepherd.agent_start``, ``shepherd.recovery`` and ``shepherd.install``;
and ``shepherd.bmc_sync``, which reads BMCs as Recovery does, on the same queue.

Each takes ``(machine_id, work_id=None)`` as strings and runs the machine's work
(``shepherd.workflows.machine_work``: adopt or claim by hand, the guard, the workflow,
the outcome). Here only Celery's side: a failure (already in the BMDB with its
backoff) or a lost claim is raised, so the task is FAILURE in Flower; a refusal to
claim by hand is raised in words a caller of ``celery call`` reads.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import bmdb
from shepherd import metrics, runtime, task_api
from shepherd.workflows import bmc_sync, guard, installation, recovery_claims
from shepherd.workflows.machine_work import run_machine_work
from tasks.celery_app import app
from tasks.errors import (
    MachineNotClaimable,
    MachineWorkFailed,
    MachineWorkLost,
    RecoveryPaused,
    ShepherdTaskError,
)


def count_pauses(decision: guard.GuardDecision) -> None:
    """Each guard decision's pause reasons, counted where it is taken (worker metrics)."""
    metrics.count_recovery_pause(decision.causes)


def run(process: bmdb.Process, machine_id: str, work_id: str | None) -> dict[str, Any]:
    """``run_machine_work`` in this worker's runtime, its outcome as Celery's."""
    started = time.monotonic()
    try:
        result = run_machine_work(app.runtime, process, uuid.UUID(machine_id),
                                  None if work_id is None else uuid.UUID(work_id),
                                  on_decision=count_pauses)
    except bmdb.NotClaimable as refused:
        raise MachineNotClaimable(str(refused)) from None
    except recovery_claims.RecoveryPaused as paused:
        raise RecoveryPaused(f"machine {machine_id} not rebooted: {paused}") from None
    if process is bmdb.Process.OS_INSTALL:
        metrics.count_installation(result.outcome, time.monotonic() - started,
                                   installation.cause_kind(result.cause))
    if result.outcome == "failed":
        raise MachineWorkFailed(f"{process.value} failed on machine {machine_id}: "
                                f"{result.cause} (backoff {result.backoff_seconds}s)")
    if result.outcome == "lost":
        raise MachineWorkLost(f"{process.value} on machine {machine_id}: {result.cause}")
    return result.to_json()


@task_api.AGENT_START.implement(app, throws=(ShepherdTaskError,))
def agent_start(machine_id: str, work_id: str | None = None) -> dict[str, Any]:
    """Start the agent on one machine (AgentStart)."""
    return run(bmdb.Process.AGENT_START, machine_id, work_id)


@task_api.RECOVERY.implement(app, throws=(ShepherdTaskError,))
def recovery(machine_id: str, work_id: str | None = None) -> dict[str, Any]:
    """Reboot one silent machine and send it back to AgentStart (Recovery)."""
    return run(bmdb.Process.RECOVERY, machine_id, work_id)


@task_api.INSTALL.implement(app, throws=(ShepherdTaskError,))
def install(machine_id: str, work_id: str | None = None) -> dict[str, Any]:
    """Have the machine's agent write and verify its wanted OS image (OSInstall)."""
    return run(bmdb.Process.OS_INSTALL, machine_id, work_id)


@task_api.BMC_SYNC.implement(app)
def sync_bmcs() -> dict[str, Any]:
    """Read the BMCs whose read is due, within the budget (the rules:
    ``shepherd.workflows.bmc_sync``); beat sends one every SHEPHERD_BMC_SYNC_TICK."""
    rt = app.runtime
    with bmc_sync.open_session(rt.db, rt.settings.session_interval) as session:
        return bmc_sync.sync(session, rt.provider, runtime.bmc_sync_settings(rt.settings),
                             runtime.bmc_driver(rt.settings)).to_json()
