"""The worker tasks as their senders see them: each task's name and typed parameters.

Why a declaration apart from the task code: tasks are sent from where the task code
is not imported. The CLI sends by name through the broker (it needs none of the
worker code, nor Celery until it sends), sourcing sends one per-machine task per
claim, and beat's schedule names the periodic ones. Sent by name, nothing checks the
arguments: a wrong one reaches a worker as a ``TypeError`` or, worse, as a wrong
value. So each task is declared here once, with a stub whose signature is the
task's (``TaskDef``), and both sides go through the declaration:

* ``tasks/`` registers the implementation with ``AGENT_START.implement(app)``, and
  the type checker holds the implementation to the declared parameters;
* a sender builds the call with ``AGENT_START.bind(machine_id, work_id)``, which
  the type checker holds to the same parameters, then ``.send(app, ...)`` it.

``tests/celery/test_task_api.py`` shows mypy refusing a wrong call, and checks that every
declared task is registered by the workers with the declared signature.

Nothing here imports Celery at run time: ``shepherd machines`` stays Celery-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar, cast

from bmdb import Process

if TYPE_CHECKING:
    from celery import Celery
    from celery import Task as CeleryTask
    from celery.result import AsyncResult

P = ParamSpec("P")
R = TypeVar("R")

#: What every Shepherd task returns: a JSON object (Flower shows it; a caller reads it).
Outcome = dict[str, Any]


@dataclass(frozen=True)
class TaskCall(Generic[R]):
    """One call of a task, its arguments checked against the declaration."""

    name: str
    args: tuple[object, ...]
    kwargs: dict[str, object]

    def send(self, app: Celery, **options: Any) -> AsyncResult[R]:
        """Send the call through ``app``'s broker (its routes choose the queue);
        ``options`` are Celery's message options (``expires``, ``queue``...)."""
        result = app.send_task(self.name, args=self.args, kwargs=self.kwargs, **options)
        return cast("AsyncResult[R]", result)

    def every(self, seconds: float, **options: Any) -> dict[str, object]:
        """An entry of beat's schedule that sends this call every ``seconds``."""
        return {"task": self.name, "schedule": seconds, "args": self.args,
                "kwargs": self.kwargs, "options": options}


@dataclass(frozen=True)
class TaskDef(Generic[P, R]):
    """A task's name and parameters; ``like`` is a stub with the task's signature."""

    name: str
    like: Callable[P, R]

    def bind(self, *args: P.args, **kwargs: P.kwargs) -> TaskCall[R]:
        return TaskCall(self.name, args, dict(kwargs))

    def implement(self, app: Celery, **options: Any
                  ) -> Callable[[Callable[P, R]], CeleryTask[P, R]]:
        """Register the decorated function as this task (``options`` as for
        ``app.task``); its signature must be the declared one."""
        def register(function: Callable[P, R]) -> CeleryTask[P, R]:
            # Celery's decorator is typed for its default task class, without P and R.
            decorate: Callable[[Callable[P, R]], object] = app.task(name=self.name,
                                                                   **options)
            return cast("CeleryTask[P, R]", decorate(function))

        return register


# -- the stubs: only their signatures are used -------------------------------------

#: Seconds a reconcile called by hand waits for a running one to end: one run is
#: bounded by its chunk and creation rate.
BY_HAND_RECONCILE_WAIT = 60.0


def _machine_task(machine_id: str, work_id: str | None = None) -> Outcome:
    """A per-machine task: adopt the claim ``work_id`` (sourcing) or claim the machine
    (by hand, without one)."""
    raise NotImplementedError


def _control_task() -> Outcome:
    raise NotImplementedError


def _reconcile(wait_for_running: float = BY_HAND_RECONCILE_WAIT) -> Outcome:
    """Beat's runs skip while another reconcile runs (``wait_for_running=0``); one called
    by hand first waits up to ``wait_for_running`` seconds for it to end."""
    raise NotImplementedError


def _source(process: str) -> Outcome:
    """``process`` is a ``bmdb.Process`` value (``ShepherdAgentStart``...)."""
    raise NotImplementedError


# -- the tasks -------------------------------------------------------------------------

AGENT_START = TaskDef("shepherd.agent_start", _machine_task)
RECOVERY = TaskDef("shepherd.recovery", _machine_task)
INSTALL = TaskDef("shepherd.install", _machine_task)
RECONCILE = TaskDef("shepherd.reconcile", _reconcile)
UPDATE = TaskDef("shepherd.update", _control_task)
SOURCE = TaskDef("shepherd.source", _source)
SWEEP = TaskDef("shepherd.sweep", _control_task)
PRUNE_HISTORY = TaskDef("shepherd.prune_history", _control_task)
RECOVERY_GUARD = TaskDef("shepherd.recovery_guard", _control_task)
#: The power and health sync: it talks to BMCs, so it runs beside the per-machine tasks.
BMC_SYNC = TaskDef("shepherd.bmc_sync", _control_task)

#: The per-machine task of each process (what sourcing and ``shepherd start`` send).
MACHINE_TASKS = {Process.AGENT_START: AGENT_START, Process.RECOVERY: RECOVERY,
                 Process.OS_INSTALL: INSTALL}

#: Every task the workers register.
ALL: tuple[TaskDef[..., Outcome], ...] = (
    AGENT_START, RECOVERY, INSTALL, RECONCILE, UPDATE, SOURCE, SWEEP, PRUNE_HISTORY, RECOVERY_GUARD,
    BMC_SYNC)
