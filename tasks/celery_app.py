"""The Celery app and the process's ``Runtime``, both from one ``Settings.from_env()``.

When Celery first loads its configuration (the first ``app.conf`` read: a worker or
beat starting, a client sending a task), the app builds the settings once, applies
``celeryconfig.celery_settings(settings)`` (broker, routes, limits, beat's schedule)
and keeps ``app.runtime = Runtime(settings, "worker:<pid>")``: the BMDB, the
provider and the live BMDB session the tasks use. Nothing is read at import, so
importing ``tasks`` (``from tasks import agent_start``) costs no settings.

Why per process, with signals: Celery's prefork pool forks children from the main
process. A session's keep-alive thread does not survive a fork and a forked
SQLAlchemy pool would share sockets with the parent, so each child forgets what it
inherited (``worker_process_init``) and builds its own on first use, and ends its
session on ``worker_process_shutdown``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from celery import Celery
from celery.signals import worker_init, worker_process_init, worker_process_shutdown

import celeryconfig
from shepherd import metrics
from shepherd.config import Settings, SettingsError
from shepherd.frozen_heap import freeze_startup_objects
from shepherd.providers.base import ConfigError
from shepherd.runtime import Runtime, check_settings, worker_component
from tasks import broker_fixes

log = logging.getLogger(__name__)


class ShepherdCelery(Celery):
    """A Celery app that configures itself from ``Settings`` and holds the ``runtime``.

    Why ``on_configure`` is a method here, not a receiver of Celery's signal of that
    name: Celery logs and swallows a signal receiver's exception, which would leave
    the app on Celery's defaults (a worker on ``amqp://localhost``, beat with no
    schedule) after a bad ``SHEPHERD_*`` value. As a method (Celery calls it in
    ``_load_config`` when it is not a signal), the ``SettingsError`` reaches whoever
    read the configuration: the worker or beat stops, a client's call fails.
    """

    def __init__(self, main: str) -> None:
        super().__init__(main)
        self._runtime: Runtime | None = None

    def on_configure(self) -> None:  # type: ignore[override]
        """Celery's configuration and this process's runtime, from one settings."""
        settings = Settings.from_env()
        self.config_from_object(celeryconfig.celery_settings(settings))
        self._runtime = Runtime(settings, worker_component())

    @property
    def runtime(self) -> Runtime:
        """This process's runtime (loading the configuration first if nothing has yet)."""
        if self._runtime is None:
            _ = self.conf.broker_url  # loads the configuration, which builds the runtime
        if self._runtime is None:
            raise RuntimeError("the Celery app was configured without its runtime")
        return self._runtime

    @runtime.setter
    def runtime(self, value: Runtime) -> None:
        """Replace the runtime (tests; the old one is the caller's to close)."""
        _ = self.conf.broker_url  # configure first, or configuring would replace ``value``
        self._runtime = value


broker_fixes.install()  # before any broker connection: see tasks/broker_fixes.py
app = ShepherdCelery("shepherd")


@worker_process_init.connect
def _after_fork(**_: Any) -> None:
    app.runtime.forget_inherited(worker_component())


@worker_process_shutdown.connect
def _on_shutdown(pid: int | None = None, **_: Any) -> None:
    runtime = app.runtime
    try:
        runtime.close()
    except Exception as error:  # shutting down: the deadline lapses by itself anyway
        log.info("closing the BMDB session at shutdown failed: %s", error)
    # Multiprocess metrics: this child's live gauges must stop counting.
    metrics.child_exited(pid or os.getpid(), runtime.settings.prometheus_multiproc_dir)


@worker_init.connect
def _refuse_unusable_settings(**_: Any) -> None:
    """Stop the worker at start when every task would fail on its settings.

    Celery logs and swallows a signal handler's exceptions, so the refusal is a
    ``SystemExit``, which it lets through: the worker exits before taking a message.
    """
    try:
        check_settings(app.runtime.settings)
    except (SettingsError, ConfigError) as error:
        log.critical("shepherd worker refuses to start: %s", error)
        raise SystemExit(2) from None


@worker_init.connect
def _no_sent_events(**_: Any) -> None:
    """What a worker sends is sourcing's dispatch, hundreds a second with a backlog:
    no ``task-sent`` event for each, which doubled what the broker carried. Flower
    lists each such task once a worker receives it (the BMDB has the claim, with its
    dispatch deadline, before that). Beat's and the CLI's sends keep theirs."""
    app.conf.task_send_sent_event = False


@worker_init.connect
def _freeze_startup_objects(**_: Any) -> None:
    """In the main process, before the pool forks: its children inherit the frozen
    heap (``shepherd.frozen_heap``)."""
    freeze_startup_objects()


@worker_init.connect
def _serve_metrics(**_: Any) -> None:
    """Serve the aggregated worker metrics from the main process (not a pool child:
    children come and go, the main process lives as long as the worker).

    Only with ``PROMETHEUS_MULTIPROC_DIR`` and ``SHEPHERD_WORKER_METRICS_PORT`` set:
    without the directory the main process would show none of its children's calls.
    """
    settings = app.runtime.settings
    port, addr = settings.worker_metrics_port, settings.worker_metrics_addr
    if not settings.prometheus_multiproc_dir or not port:
        return
    try:
        metrics.serve_worker_metrics(port, addr, settings.prometheus_multiproc_dir)
    except OSError as error:  # metrics must never stop the worker
        log.error("cannot serve worker metrics on %s:%s: %s", addr, port, error)
        return
    log.info("worker metrics on http://%s:%s/metrics", addr, port)
