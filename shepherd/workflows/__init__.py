"""The workflows as plain Python (no Celery): reconcile and update (fleet-wide),
sourcing, AgentStart and Recovery (per machine).

A per-machine task runs one call, which adopts (or claims) the machine's work, asks
the guard where Recovery needs it, runs the workflow and says how it ended::

    result = run_machine_work(runtime, bmdb.Process.AGENT_START, machine_id, work_id)

Under it, ``initialize(work, provider, settings)`` and ``recover(work, provider,
power_for, settings)`` finish or fail the work on every path and return a
``WorkflowResult`` (JSON-able via ``to_json``, no secrets); only ``WorkGone``,
``SessionExpired`` and ``CommitOutcomeUnknown`` propagate.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shepherd.workflows.common import PERMANENT_BACKOFF, WorkflowFailure, WorkflowResult
    from shepherd.workflows.guard import recovery_paused
    from shepherd.workflows.initializer import InitializerSettings, initialize
    from shepherd.workflows.machine_work import MachineWorkResult, run_machine_work
    from shepherd.workflows.provisioner import (
        FleetMismatch,
        ProvisionerSettings,
        ReconcileResult,
        reconcile,
    )
    from shepherd.workflows.recoverer import RecovererSettings, recover
    from shepherd.workflows.updater import UpdateResult, UpdaterSettings, update

#: Where each name below lives. Loaded on first use (PEP 562), not with the package:
#: ``shepherd.workflows.guard`` is read by every operator command, which must not load
#: SSH (fabric, paramiko) and the BMC drivers with the package.
_HOMES = {
    "PERMANENT_BACKOFF": "common", "WorkflowFailure": "common", "WorkflowResult": "common",
    "recovery_paused": "guard",
    "InitializerSettings": "initializer", "initialize": "initializer",
    "MachineWorkResult": "machine_work", "run_machine_work": "machine_work",
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
    "MachineWorkResult",
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
    "run_machine_work",
    "update",
]
