"""Per worker process state: settings, the BMDB handle, the provider, one BMDB session.

Why per process: Celery's prefork pool forks children from the main process. A
session's keep-alive thread does not survive a fork and a forked SQLAlchemy pool
would share sockets with the parent, so each child builds its own on first use
(``worker_process_init`` drops anything inherited) and ends its session on
``worker_process_shutdown``. A session that expired (``alive`` False) is replaced
on the next use; the sweep releases whatever the old one held.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from celery.signals import worker_init, worker_process_init, worker_process_shutdown

import bmdb
from shepherd import metrics, runtime
from shepherd.config import Settings, SettingsError
from shepherd.providers import Provider
from shepherd.providers.base import ConfigError

log = logging.getLogger(__name__)


class WorkerState:
    """Lazily built, replaced when dead; thread-safe for thread pools too."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._settings: Settings | None = None
        self._db: bmdb.BMDB | None = None
        self._provider: Provider | None = None
        self._session: bmdb.Session | None = None
        self.pid = os.getpid()

    @property
    def settings(self) -> Settings:
        with self._lock:
            if self._settings is None:
                self._settings = Settings.from_env()
            return self._settings

    @property
    def db(self) -> bmdb.BMDB:
        with self._lock:
            if self._db is None:
                self._db = runtime.connect_bmdb(self.settings)
            return self._db

    @property
    def provider(self) -> Provider:
        with self._lock:
            if self._provider is None:
                self._provider = runtime.build_provider(self.settings)
            return self._provider

    @property
    def session(self) -> bmdb.Session:
        with self._lock:
            if self._session is None or not self._session.alive:
                if self._session is not None:
                    log.warning("BMDB session %s is no longer alive; starting a new one",
                                self._session.id)
                    self._session.close()
                self._session = self.db.start_session(
                    f"worker:{os.getpid()}", interval=self.settings.session_interval)
                log.info("BMDB session %s started in process %d", self._session.id,
                         os.getpid())
            return self._session

    def forget_inherited(self) -> None:
        """After a fork: drop the parent's objects without touching what they share with it.

        ``dispose(close=False)`` leaves the parent's pooled connections open for the
        parent while this child forgets them.
        """
        with self._lock:
            if self._db is not None:
                self._db.engine.dispose(close=False)
            self._db = None
            self._session = None
            self._provider = None
            self.pid = os.getpid()

    def close(self) -> None:
        with self._lock:
            if self._session is not None:
                self._session.close()
                self._session = None
            if self._db is not None:
                self._db.close()
                self._db = None


STATE = WorkerState()


@worker_process_init.connect
def _after_fork(**_: Any) -> None:
    STATE.forget_inherited()


@worker_process_shutdown.connect
def _on_shutdown(pid: int | None = None, **_: Any) -> None:
    try:
        STATE.close()
    except Exception as error:  # shutting down: the deadline lapses by itself anyway
        log.info("closing the BMDB session at shutdown failed: %s", error)
    # Multiprocess metrics: this child's live gauges must stop counting.
    metrics.child_exited(pid or os.getpid())


@worker_init.connect
def _refuse_unusable_settings(**_: Any) -> None:
    """Stop the worker at start when every task would fail on its settings.

    Celery logs and swallows a signal handler's exceptions, so the refusal is a
    ``SystemExit``, which it lets through: the worker exits before taking a message.
    """
    try:
        runtime.check_settings(Settings.from_env())
    except (SettingsError, ConfigError) as error:
        log.critical("shepherd worker refuses to start: %s", error)
        raise SystemExit(2) from None


#: Port of the worker host's metrics endpoint (provider calls of every pool process);
#: only with PROMETHEUS_MULTIPROC_DIR set, since without it the main process would
#: show none of its children's calls.
METRICS_PORT_ENV = "SHEPHERD_WORKER_METRICS_PORT"


@worker_init.connect
def _serve_metrics(**_: Any) -> None:
    """Serve the aggregated worker metrics from the main process (not a pool child:
    children come and go, the main process lives as long as the worker)."""
    port = os.environ.get(METRICS_PORT_ENV)
    if not metrics.multiprocess_dir() or not port:
        return
    addr = os.environ.get("SHEPHERD_WORKER_METRICS_ADDR", "127.0.0.1")
    try:
        metrics.serve_worker_metrics(int(port), addr=addr)
    except (OSError, ValueError) as error:  # metrics must never stop the worker
        log.error("cannot serve worker metrics on %s:%s: %s", addr, port, error)
        return
    log.info("worker metrics on http://%s:%s/metrics", addr, port)
