"""The workflows as plain Python (no Celery): reconcile and update (fleet-wide),
AgentStart and Recovery (per machine).

A Celery task adopts (or claims) a ``bmdb.Work`` and calls::

    result = initialize(work, provider, InitializerSettings(ssh_key_path=..., callback_url=...))
    result = recover(work, provider, power_for, RecovererSettings())
    reason = recovery_paused(db, thresholds)        # before sourcing Recovery at all

Both workflows finish or fail the work on every path and return a ``WorkflowResult``
(JSON-able via ``to_json``, no secrets); only ``WorkGone``, ``SessionExpired`` and
``CommitOutcomeUnknown`` propagate.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

#: Where each name below lives. Loaded on first use (PEP 562), not with the package:
#: ``shepherd.workflows.guard`` is read by every operator command, and importing the
#: package used to load SSH (fabric, paramiko) and the BMC drivers with it (issue 14).
_HOMES = {
    "PERMANENT_BACKOFF": "common", "WorkflowFailure": "common", "WorkflowResult": "common",
    "recovery_paused": "guard",
    "InitializerSettings": "initializer", "initialize": "initializer",
    "FleetMismatch": "provisioner", "ProvisionerSettings": "provisioner",
    "ReconcileResult": "provisioner", "reconcile": "provisioner",
    "RecovererSettings": "recoverer", "recover": "recoverer",
    "UpdateResult": "updater", "UpdaterSettings": "updater", "update": "updater",
}


def __getattr__(name: str) -> Any:
    """The exported ``name``, imported from its module on first use."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


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
