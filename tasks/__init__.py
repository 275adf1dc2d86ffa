"""Celery glue over the shepherd workflows: ``celery -A tasks worker``.

Tasks stay thin: each adopts or claims BMDB work and calls a workflow in ``shepherd``.

=====================  ===============================  ===================
task                   arguments                        queue
=====================  ===============================  ===================
shepherd.reconcile     ()                               shepherd.control
shepherd.update        ()                               shepherd.control
shepherd.source        (process: str)                   shepherd.control
shepherd.sweep         ()                               shepherd.control
shepherd.recovery_guard ()                              shepherd.control
shepherd.agent_start   (machine_id: str, work_id=None)  shepherd.machines
shepherd.recovery      (machine_id: str, work_id=None)  shepherd.machines
=====================  ===============================  ===================

By hand::

    celery -A tasks call shepherd.agent_start --args='["<machine uuid>"]'
    celery -A tasks call shepherd.source --args='["ShepherdRecovery"]'

or from Python: ``from tasks import agent_start; agent_start.delay(str(machine_id)).get()``.
"""

from __future__ import annotations

from celery import Celery

from tasks import broker_fixes

broker_fixes.install()  # before any broker connection: see tasks/broker_fixes.py
app = Celery("shepherd")
app.config_from_object("celeryconfig")

# Registered on import, so ``-A tasks`` and ``from tasks import ...`` both see them.
from tasks.control import reconcile, recovery_guard_status, source, sweep, update  # noqa: E402
from tasks.machines import agent_start, recovery  # noqa: E402

__all__ = [
    "agent_start",
    "app",
    "reconcile",
    "recovery",
    "recovery_guard_status",
    "source",
    "sweep",
    "update",
]
