"""The CLI's hand-over to Celery: imported by ``shepherd start`` / ``shepherd reconcile``.

``shepherd.cli`` claims the machine itself (so it can say at once why a machine is
not claimable) and then calls a start hook with the claim; the hook only dispatches
the per-machine task with the claim's work id, exactly as sourcing does, so the
worker adopts the claim and a duplicate or late message ends as "gone". The claim
is not ours to run: the CLI waits until a worker adopted it and cancels it if none
did in time.

Reconcile goes through the broker too (not run in the CLI process) so that it runs
under a worker's session and provider budget, once at a time fleet-wide.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from celery.exceptions import TimeoutError as CeleryTimeout

import bmdb
from shepherd import cli
from shepherd.config import Settings
from tasks.control import reconcile
from tasks.machines import TASKS

#: How long ``shepherd reconcile`` waits for the result (``SHEPHERD_RECONCILE_WAIT``).
DEFAULT_RECONCILE_WAIT = 300.0


def start_hook(process: bmdb.Process) -> Callable[[Any], str]:
    """A hook that dispatches ``process``'s task for one claim; returns the task id."""
    task = TASKS[process]

    def dispatch(work: Any) -> str:
        ttl = Settings.from_env().dispatch_ttl
        # Expires with the claim: a message nobody took before the sweep cancels the
        # claim would only end as "gone" anyway.
        result = task.apply_async((str(work.machine_id), str(work.id)), expires=ttl)
        return str(result.id)

    return dispatch


def reconcile_now(wait: float | None = None) -> dict[str, Any]:
    """Send ``shepherd.reconcile`` and wait for what it did (raises what it raised)."""
    if wait is None:
        wait = float(os.environ.get("SHEPHERD_RECONCILE_WAIT", DEFAULT_RECONCILE_WAIT))
    result = reconcile.apply_async()
    try:
        return result.get(timeout=wait, propagate=True, disable_sync_subtasks=False)
    except CeleryTimeout:
        raise TimeoutError(f"no result from reconcile task {result.id} within {wait:g}s "
                           "(is a control worker running?)") from None


def install() -> None:
    """Fill the CLI's hook slots (called on import)."""
    for process in TASKS:
        cli.start_hooks[process] = start_hook(process)
    cli.reconcile_hook = reconcile_now


install()
