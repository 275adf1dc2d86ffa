"""Celery glue over the shepherd workflows: ``celery -A tasks worker``.

Tasks stay thin: each is a few lines around one workflow function of ``shepherd``
(``shepherd.workflows``: the rules live there), called with what ``app.runtime``
(``tasks/celery_app.py``) built from the settings; the task only turns its outcome
into Celery's (a result, or a ``tasks.errors`` exception). Each is declared, name and
parameters, in ``shepherd/task_api.py``; send them through it.

=====================  ===============================  ===================
task                   arguments                        queue
=====================  ===============================  ===================
shepherd.reconcile     ()                               shepherd.control
shepherd.update        ()                               shepherd.control
shepherd.source        (process: str)                   shepherd.control
shepherd.sweep         ()                               shepherd.control
shepherd.recovery_guard ()                              shepherd.control
shepherd.prune_history ()                               shepherd.control
shepherd.agent_start   (machine_id: str, work_id=None)  shepherd.machines
shepherd.recovery      (machine_id: str, work_id=None)  shepherd.machines
shepherd.install       (machine_id: str, work_id=None)  shepherd.installations
=====================  ===============================  ===================

By hand::

    celery -A tasks call shepherd.agent_start --args='["<machine uuid>"]'
    celery -A tasks call shepherd.source --args='["ShepherdRecovery"]'

or from Python: ``from tasks import agent_start; agent_start.delay(str(machine_id)).get()``.
"""

from __future__ import annotations

from tasks.celery_app import app

# Registered on import, so ``-A tasks`` and ``from tasks import ...`` both see them.
from tasks.control import (
    prune_history,
    reconcile,
    recovery_guard_status,
    source,
    sweep,
    update,
)
from tasks.machines import agent_start, install, recovery

__all__ = [
    "agent_start",
    "app",
    "install",
    "prune_history",
    "reconcile",
    "recovery",
    "recovery_guard_status",
    "source",
    "sweep",
    "update",
]
