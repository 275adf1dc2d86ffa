"""Celery settings from ``shepherd.config.Settings``: ``celery_settings(settings)``.

Nothing is read at import: the tasks app (``tasks/app.py``) builds one
``Settings.from_env()`` when Celery first loads its configuration and applies
``celery_settings(settings)``, so a worker, beat and a client all configure Celery
from the same settings as the rest of the process (beat's schedule included).

Embedded default: a SQLite-backed broker under ./var, so one host needs no Redis;
production points SHEPHERD_BROKER_URL at Redis.

Reliability, and why it is safe (docs/ARCHITECTURE.md):

* Messages are acknowledged after the task ran (``task_acks_late``) and given back
  when a worker process dies under them (``task_reject_on_worker_lost``), so a lost
  worker loses no message. A per-machine message delivered twice cannot work a
  machine twice: the second delivery fails to adopt its claim (``WorkGone``: already
  adopted, or released) and ends as SUCCESS with ``{"outcome": "gone"}``, untouched.
* Each worker process takes one message at a time (prefetch 1): a slow SSH task must
  not sit on messages another process could run, and with late acks a prefetched
  message would wait out the whole task.
* The Redis visibility timeout (after which an unacknowledged message is delivered
  again) is far above the per-machine hard time limit.
* Nothing is retried by Celery: failures go to the BMDB as backoffs.
"""

from __future__ import annotations

from typing import Any

from kombu import Exchange, Queue

from bmdb import Process
from shepherd import task_api
from shepherd.config import Settings
from shepherd.task_api import AGENT_START, BMC_SYNC, INSTALL, RECOVERY, TaskCall

CONTROL_QUEUE = "shepherd.control"
MACHINES_QUEUE = "shepherd.machines"
#: Installations wait minutes on their agents: a queue and a worker of their own, so
#: they never take the places AgentStart and Recovery need (``shepherd up`` starts it).
INSTALLATIONS_QUEUE = "shepherd.installations"
#: Each per-machine task's queue.
MACHINE_QUEUES = {AGENT_START.name: MACHINES_QUEUE, RECOVERY.name: MACHINES_QUEUE,
                  INSTALL.name: INSTALLATIONS_QUEUE}

#: Control work (reconcile, update, sourcing, sweep, pruning history) never waits behind
#: slow SSH work.
ROUTING: dict[str, Any] = {
    "task_queues": tuple(Queue(name, Exchange(name, type="direct"), routing_key=name)
                         for name in (CONTROL_QUEUE, MACHINES_QUEUE, INSTALLATIONS_QUEUE)),
    "task_default_queue": CONTROL_QUEUE,
    "task_default_exchange": CONTROL_QUEUE,
    "task_default_routing_key": CONTROL_QUEUE,
    "task_routes": {
        **{name: {"queue": queue} for name, queue in MACHINE_QUEUES.items()},
        # The power and health sync talks to BMCs: beside Recovery, never before control.
        BMC_SYNC.name: {"queue": MACHINES_QUEUE},
        "shepherd.*": {"queue": CONTROL_QUEUE},
    },
}

#: The shortest life of a beat message. Why not just the interval: a message waits for
#: a free pool process, and with sub-second intervals (tests, demos) it would expire
#: before it ran whenever SSH work keeps the pool busy, starving sourcing.
MIN_EXPIRES = 10.0


def celery_settings(settings: Settings) -> dict[str, Any]:
    """Celery's configuration keys for ``settings``."""
    machine_task_limits = {"time_limit": settings.machine_task_time_limit,
                           "soft_time_limit": settings.machine_task_soft_time_limit}
    # The workflow bounds an installation by its deadline; the limits are the backstop.
    install_limits = {"time_limit": settings.install_task_time_limit,
                      "soft_time_limit": settings.install_task_time_limit - 60.0}
    return {
        "broker_url": settings.broker_url,
        "result_backend": settings.result_backend,
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": transport_options(settings.broker_url, settings),
        "result_backend_transport_options": transport_options(settings.result_backend,
                                                              settings),
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "timezone": "UTC",
        "enable_utc": True,
        **ROUTING,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        # A lost broker connection must not cancel running SSH work: the redelivered
        # message fails to adopt its claim and ends as "gone" (see above).
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "task_annotations": {AGENT_START.name: machine_task_limits,
                             RECOVERY.name: machine_task_limits,
                             INSTALL.name: install_limits},
        # Flower shows every task with its name, arguments and result (which never
        # carry secrets). Workers turn task-sent events off (tasks/celery_app.py).
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "task_track_started": True,
        "result_extended": True,
        "beat_schedule": beat_schedule(settings),
    }


def transport_options(url: str, settings: Settings) -> dict[str, object]:
    """Redis redelivers an unacknowledged message after its visibility timeout, which
    must outlast the longest task. kombu's SQLAlchemy transport (the embedded SQLite
    broker) hands every option to ``create_engine`` instead: it gets a busy timeout
    so a write by another process is waited out rather than failing."""
    if url.startswith("sqla+"):
        return {"connect_args": {"timeout": 30}}
    if url.startswith(("redis://", "rediss://")):
        return {"visibility_timeout": settings.visibility_timeout}
    return {}


def periodic_expiry(seconds: float) -> float:
    """How long a message of periodic work sent every ``seconds`` lives: a stale one
    (the next is on its way) expires, so that a backed-up control queue does not run
    the same periodic work many times over."""
    return max(seconds, MIN_EXPIRES)


def _every(seconds: float, call: TaskCall[Any]) -> dict[str, object]:
    return call.every(seconds, expires=periodic_expiry(seconds))


def beat_schedule(settings: Settings) -> dict[str, dict[str, object]]:
    """What beat sends; an interval of 0 leaves that entry out (e.g. no reconcile)."""
    schedule: dict[str, tuple[float, TaskCall[Any]]] = {
        "reconcile": (settings.reconcile_interval, task_api.RECONCILE.bind(wait_for_running=0)),
        "update": (settings.update_interval, task_api.UPDATE.bind()),
        "source-agent-start": (settings.source_interval,
                               task_api.SOURCE.bind(Process.AGENT_START.value)),
        "source-recovery": (settings.source_interval,
                            task_api.SOURCE.bind(Process.RECOVERY.value)),
        "source-install": (settings.source_interval,
                           task_api.SOURCE.bind(Process.OS_INSTALL.value)),
        "sweep": (settings.sweep_interval, task_api.SWEEP.bind()),
        "bmc-sync": (settings.bmc_sync_tick if settings.bmc_sync_interval > 0 else 0,
                     task_api.BMC_SYNC.bind()),
        # Nothing to prune when history is kept for ever.
        "prune-history": (settings.history_prune_interval if settings.history_keep else 0,
                          task_api.PRUNE_HISTORY.bind()),
    }
    return {name: _every(seconds, call) for name, (seconds, call) in schedule.items()
            if seconds > 0}
