"""The CLI's way to the worker layer: tasks sent by name through the broker.

Why by name (``send_task``) and not by importing ``tasks``: the CLI needs none of
the task code, only the broker the workers listen on and the tasks' declarations
(``shepherd.task_api``), the contract between the two layers. The CLI builds its
own small Celery client from the same ``Settings`` the workers use, so both agree on
broker, routes and backend.

``shepherd start`` claims the machine itself (so it can say at once why a machine is
not claimable) and hands the claim over exactly as sourcing does: the per-machine
task gets the claim's work id, a worker adopts it, and a late or duplicate message
ends as "gone". Reconcile runs in a worker too, under its session and provider
budget, once at a time fleet-wide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import bmdb
from shepherd import task_api
from shepherd.config import Settings

if TYPE_CHECKING:
    from celery import Celery


class WorkerLayer(Protocol):
    """What the CLI asks of the workers; tests hand ``main`` their own."""

    def dispatch(self, work: bmdb.Work) -> str:
        """Send the per-machine task for ``work`` (a claim with a dispatch deadline);
        returns the task id."""
        ...

    def reconcile(self) -> Any:
        """Run a reconcile in a worker and return what it did (raises what it raised)."""
        ...


class CeleryWorkers:
    """The worker layer through the configured broker (``Settings.broker_url``)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._app: Celery | None = None

    @property
    def app(self) -> Celery:
        if self._app is None:
            from celery import Celery

            from celeryconfig import celery_settings

            self._app = Celery("shepherd-cli", set_as_current=False)
            self._app.conf.update(celery_settings(self.settings))
        return self._app

    def dispatch(self, work: bmdb.Work) -> str:
        # Expires with the claim: a message nobody took before the sweep cancels the
        # claim would only end as "gone" anyway.
        call = task_api.MACHINE_TASKS[work.process].bind(str(work.machine_id), str(work.id))
        result = call.send(self.app, expires=self.settings.dispatch_ttl)
        return str(result.id)

    def reconcile(self) -> Any:
        from celery.exceptions import TimeoutError as CeleryTimeout

        wait = self.settings.reconcile_wait
        result = task_api.RECONCILE.bind().send(self.app)
        try:
            return result.get(timeout=wait, propagate=True, disable_sync_subtasks=False)
        except CeleryTimeout:
            raise TimeoutError(f"no result from reconcile task {result.id} within {wait:g}s "
                               "(is a control worker running?)") from None
