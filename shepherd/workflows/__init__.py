"""The workflows as plain Python (no Celery): reconcile and update (fleet-wide),
AgentStart and Recovery (per machine).

A Celery task adopts (or claims) a ``bmdb.Work`` and calls::

    result = initialize(work, provider, InitializerSettings(ssh_key_path=..., bmaas_endpoint=...))
    result = recover(work, provider, power_for, RecovererSettings())
    reason = recovery_paused(db, thresholds)        # before sourcing Recovery at all

Both workflows finish or fail the work on every path and return a ``WorkflowResult``
(JSON-able via ``to_json``, no secrets); only ``WorkGone``, ``SessionExpired`` and
``CommitOutcomeUnknown`` propagate.
"""

from shepherd.workflows.common import PERMANENT_BACKOFF, WorkflowFailure, WorkflowResult
from shepherd.workflows.guard import recovery_paused
from shepherd.workflows.initializer import InitializerSettings, initialize
from shepherd.workflows.provisioner import (
    FleetMismatch,
    ProvisionerSettings,
    ReconcileResult,
    reconcile,
)
from shepherd.workflows.recoverer import RecovererSettings, recover
from shepherd.workflows.updater import UpdateResult, UpdaterSettings, update

__all__ = [
    "PERMANENT_BACKOFF",
    "FleetMismatch",
    "InitializerSettings",
    "ProvisionerSettings",
    "ReconcileResult",
    "RecovererSettings",
    "UpdateResult",
    "UpdaterSettings",
    "WorkflowFailure",
    "WorkflowResult",
    "initialize",
    "reconcile",
    "recover",
    "recovery_paused",
    "update",
]
