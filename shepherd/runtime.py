"""The composition root: everything a process builds from one ``Settings``.

Each entry point (a Celery worker or beat, ``shepherd serve``, the CLI) builds one
``Runtime(settings, component)`` and passes what its code needs down as arguments:
the BMDB with the configured thresholds, backoffs and pool size, the provider, one
live BMDB session, the guard's limits and the settings objects of each workflow. No
Celery here, so a shell or a test can use it too::

    rt = Runtime(Settings.from_env(), "shell")
    run_machine_work(rt, bmdb.Process.AGENT_START, machine_id)
    rt.close()
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import bmdb
from shepherd.config import Settings, SettingsError
from shepherd.providers import Provider
from shepherd.providers.base import API_PROVIDERS, ProviderMachine, refuse_placeholder
from shepherd.redaction import database_url_problem, redact_url
from shepherd.workflows.guard import GuardLimits

# What only workers and servers use loads where it is used: the CLI builds a Runtime
# for every command, and would otherwise load SSH, the metrics and the key library.
if TYPE_CHECKING:
    from shepherd.bmc import BmcSpec
    from shepherd.power import BmcControl, PowerControl
    from shepherd.workflows.bmc_sync import SyncSettings as BmcSyncSettings
    from shepherd.workflows.initializer import InitializerSettings
    from shepherd.workflows.installation import InstallationSettings
    from shepherd.workflows.ladder import LadderSettings
    from shepherd.workflows.provisioner import ProvisionerSettings
    from shepherd.workflows.recoverer import RecovererSettings
    from shepherd.workflows.retention import RetentionSettings
    from shepherd.workflows.sourcing import SourcingSettings
    from shepherd.workflows.updater import UpdaterSettings

log = logging.getLogger(__name__)
T = TypeVar("T")


class Runtime:
    """One process's BMDB, provider and live BMDB session, built lazily from ``settings``.

    Why one object: every part of a process (a worker's tasks, the callback server,
    the web view, the metrics) must judge with the same thresholds, backoffs and
    guard limits, and hold one BMDB session between them; two holders would read
    settings twice and could disagree. Everything here is built on first use, so a
    process that never touches the provider never calls it, and is thread-safe (the
    callback server's and Celery's thread pools share one). ``db`` and ``provider``
    may be given (tests, embedded use); a given BMDB is not closed by ``close()``.
    It is what a machine's work takes (``machine_work.MachineParts``).
    """

    def __init__(self, settings: Settings, component: str, *, db: bmdb.BMDB | None = None,
                 provider: Provider | None = None) -> None:
        self.settings = settings
        #: The session holder name (``worker:<pid>``, ``callback-server``...).
        self.component = component
        self._lock = threading.RLock()
        self._db = db
        self._owns_db = db is None
        self._provider = provider
        self._session: bmdb.Session | None = None

    def __repr__(self) -> str:
        return f"Runtime({self.component!r})"

    @property
    def db(self) -> bmdb.BMDB:
        with self._lock:
            if self._db is None:
                self._db = connect_bmdb(self.settings)
                self._owns_db = True
            return self._db

    @property
    def provider(self) -> Provider:
        with self._lock:
            if self._provider is None:
                self._provider = build_provider(self.settings)
            return self._provider

    @property
    def session(self) -> bmdb.Session:
        """The live BMDB session, started on first use and replaced once it expired
        (``alive`` False); the sweep releases whatever the old one held."""
        with self._lock:
            if self._session is None or not self._session.alive:
                if self._session is not None:
                    log.warning("BMDB session %s is no longer alive; starting a new one",
                                self._session.id)
                    self._session.close()
                self._session = self.db.start_session(
                    self.component, interval=self.settings.session_interval)
                log.info("BMDB session %s started for %s", self._session.id, self.component)
            return self._session

    def transact(self, body: Callable[[bmdb.Tx], T]) -> T:
        """Run ``body`` in the session; once more in a new session if this one expired
        meanwhile (``body`` must be safe to run again: it is one transaction)."""
        try:
            return self.session.transact(body)
        except bmdb.SessionExpired:
            return self.session.transact(body)

    def guard_limits(self, *, interactive: bool = False) -> GuardLimits:
        return guard_limits(self.settings, interactive=interactive)

    def power_for(self, machine: ProviderMachine) -> PowerControl | None:
        """``power_for`` with this process's settings, provider and session."""
        return power_for(self.settings, self.provider, self.session, machine)

    def initializer_settings(self) -> InitializerSettings:
        return initializer_settings(self.settings)

    def recoverer_settings(self) -> RecovererSettings:
        return recoverer_settings(self.settings)

    def installation_settings(self) -> InstallationSettings:
        return installation_settings(self.settings)

    def forget_inherited(self, component: str | None = None) -> None:
        """After a fork: drop the parent's objects without touching what they share with it.

        A session's keep-alive thread does not survive a fork and a forked SQLAlchemy
        pool would share sockets with the parent: the child forgets the pooled
        connections without closing them, so the parent keeps its own.
        Everything is built again on first use, under ``component`` when given (a
        worker child's ``worker:<pid>``).
        """
        with self._lock:
            if self._db is not None:
                self._db.forget_inherited_connections()
            self._db = None
            self._owns_db = True
            self._session = None
            self._provider = None
            if component is not None:
                self.component = component

    def close(self) -> None:
        """End the session (its work is released by the sweep) and close our BMDB."""
        with self._lock:
            if self._session is not None:
                session, self._session = self._session, None
                session.close()
            if self._db is not None and self._owns_db:
                db, self._db = self._db, None
                db.close()


def worker_component() -> str:
    """The session holder name of this worker process (the pid tells hosts' children apart)."""
    return f"worker:{os.getpid()}"


def connect_bmdb(settings: Settings) -> bmdb.BMDB:
    """The BMDB with the configured silence thresholds, backoffs and pool size (the
    schema is migrated elsewhere: ``shepherd migrate``, so that many workers starting at
    once do not race on it). A URL SQLAlchemy would misread is refused before
    connecting (``check_bmdb_url``)."""
    check_bmdb_url(settings.bmdb_url)
    return bmdb.connect(settings.bmdb_url, thresholds=settings.thresholds,
                        backoffs=backoffs(settings), pool_size=settings.bmdb_pool_size)


def backoffs(settings: Settings) -> dict[bmdb.Process, bmdb.Backoff]:
    """The configured backoffs (``SHEPHERD_<PROCESS>_BACKOFF``), which the BMDB gives a
    failure that names none: so the workflows never carry them."""
    return {bmdb.Process.AGENT_START: settings.agent_start_backoff,
            bmdb.Process.RECOVERY: settings.recovery_backoff,
            bmdb.Process.OS_INSTALL: settings.install_backoff}


def check_bmdb_url(url: str) -> None:
    """``SettingsError`` for a BMDB URL whose user info SQLAlchemy would misread, or
    whose database driver is not installed here.

    Why: with an unencoded '@' in the password, the rest of the password becomes the
    host, and every connection error (worker logs, task results, the CLI) would
    print it; a missing driver would fail every request of a process that had started
    as if all was well. The URL is shown through ``redact_url`` only.
    """
    problem = database_url_problem(url)
    if problem is None:
        try:
            bmdb.load_driver(bmdb.parse_url(url))
        except (bmdb.UnknownDialect, bmdb.DriverMissing) as error:
            problem = str(error)
        except bmdb.BadURL:
            problem = "not a database URL"
    if problem is not None:
        raise SettingsError(f"SHEPHERD_BMDB_URL={redact_url(url)!r}: {problem}")


def check_settings(settings: Settings) -> None:
    """Refuse settings every task would fail on (``SettingsError`` / ``ConfigError``).

    Why apart from ``build_provider``: a worker checks them as it starts, without a
    provider call, so a placeholder prefix stops the worker with one clear line
    instead of failing (and backing off) every machine it is handed.
    """
    check_bmdb_url(settings.bmdb_url)
    if settings.provider in API_PROVIDERS:
        refuse_placeholder("SHEPHERD_DEVICE_PREFIX", settings.device_prefix)
        refuse_placeholder("SHEPHERD_SSH_KEY_LABEL", settings.ssh_key_label)
    elif settings.provider == "static":
        if not settings.static_inventory:
            raise SettingsError("SHEPHERD_PROVIDER=static needs SHEPHERD_STATIC_INVENTORY")
    else:
        raise SettingsError(f"SHEPHERD_PROVIDER={settings.provider!r}: expected simulator, "
                            "equinix or static")
    if settings.bmc_calls_reserved >= settings.bmc_calls_max:
        raise SettingsError(
            f"SHEPHERD_BMC_CALLS_RESERVED={settings.bmc_calls_reserved} must leave the power "
            f"and health sync at least one of SHEPHERD_BMC_CALLS_MAX={settings.bmc_calls_max}")
    if settings.prometheus_multiproc_dir:
        check_writable_directory("PROMETHEUS_MULTIPROC_DIR", settings.prometheus_multiproc_dir)
    if settings.visibility_timeout <= settings.machine_task_time_limit:
        # Redis would hand a running Recovery's message to a second worker.
        raise SettingsError(
            f"SHEPHERD_VISIBILITY_TIMEOUT={settings.visibility_timeout:g} must exceed a "
            f"machine task's time limit, {settings.machine_task_time_limit:g}s (from the SSH "
            "timeouts and the reboot ladder: SHEPHERD_RUNG_TIMEOUT, SHEPHERD_BOOT_WAIT, "
            "SHEPHERD_BMC_TIMEOUT/ATTEMPTS/LOCK_WAIT)")
    if settings.visibility_timeout <= settings.install_task_time_limit:
        raise SettingsError(
            f"SHEPHERD_VISIBILITY_TIMEOUT={settings.visibility_timeout:g} must exceed an "
            f"installation task's time limit, {settings.install_task_time_limit:g}s "
            "(SHEPHERD_INSTALL_DEADLINE, twice SHEPHERD_RUNG_TIMEOUT, "
            "SHEPHERD_INSTALL_SSH_DEADLINE, SHEPHERD_INSTALL_HEARTBEAT_DEADLINE and 300 s)")


def check_writable_directory(name: str, path: str) -> None:
    """Refuse a directory every task writes to but this user cannot: prometheus_client
    opens its shared file there at a task's first metric, so each machine would fail
    and back off instead (a restarted container's tmpfs can come back root-owned)."""
    if not os.path.isdir(path):
        raise SettingsError(f"{name}={path} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise SettingsError(f"{name}={path} is not writable by this user "
                            f"(uid {os.getuid()}); every task would fail on it")


def build_provider(settings: Settings) -> Provider:
    """The configured provider, with the shepherd's SSH key registered at it.

    Called once per worker process: registration is idempotent (``ensure_registered``)
    but costs API calls, and the key must be known before the first device is created.
    """
    from shepherd import metrics
    from shepherd.providers import ssh_keys

    check_settings(settings)
    if settings.provider in API_PROVIDERS:
        from shepherd.providers.equinix import (
            DEFAULT_BASE_URL,
            ClientConfig,
            EquinixClient,
            EquinixProvider,
            ProviderConfig,
        )

        client = EquinixClient(ClientConfig(
            token=settings.provider_token, project_id=settings.provider_project,
            base_url=settings.provider_url or DEFAULT_BASE_URL,
            min_interval=settings.provider_min_interval,
            max_in_flight=settings.provider_max_in_flight,
        ), observer=functools.partial(metrics.provider_call, provider=settings.provider))
        # Named as configured: the simulator speaks Equinix's API, but its machines are
        # recorded (Provided.provider), shown and counted as the simulator's.
        provider = EquinixProvider(client, ProviderConfig(
            device_prefix=settings.device_prefix, ssh_key_label=settings.ssh_key_label,
            ssh_port=settings.provider_ssh_port, name=settings.provider,
        ))
        key = ssh_keys.load_or_create(settings.ssh_key_path)
        provider.ensure_ssh_key(ssh_keys.public_key_openssh(key),
                                replace=settings.ssh_key_replace)
        return provider
    from shepherd.inventory.provider import StaticProvider

    ssh_keys.load_or_create(settings.ssh_key_path)  # operators install it by hand
    return StaticProvider(settings.static_inventory)


def initializer_settings(settings: Settings) -> InitializerSettings:
    from shepherd.workflows.initializer import InitializerSettings

    ca = Path(settings.callback_ca_file).read_text() if settings.callback_ca_file else None
    return InitializerSettings(
        ssh_key_path=settings.ssh_key_path, callback_url=settings.callback_url,
        ca_certificate=ca, connect_timeout=settings.ssh_connect_timeout,
        exec_timeout=settings.ssh_exec_timeout, agent_args=settings.agent_args,
        heartbeat_interval=settings.agent_interval,
    )


def ladder_settings(settings: Settings) -> LadderSettings:
    from shepherd.workflows.ladder import LadderSettings

    return LadderSettings(rung_timeout=settings.rung_timeout, boot_wait=settings.boot_wait,
                          poll_interval=settings.rung_poll_interval,
                          banner_timeout=min(5.0, settings.ssh_connect_timeout))


def recoverer_settings(settings: Settings) -> RecovererSettings:
    from shepherd.workflows.recoverer import RecovererSettings

    return RecovererSettings(
        ladder=ladder_settings(settings),
        quarantine_after=settings.quarantine_after,
        agent_restart=initializer_settings(settings),
    )


def installation_settings(settings: Settings) -> InstallationSettings:
    from shepherd.power import BootDevice
    from shepherd.workflows.booting import BootSettings
    from shepherd.workflows.installation import InstallationSettings

    boot = BootSettings(
        takeover=initializer_settings(settings), ladder=ladder_settings(settings),
        ssh_deadline=settings.install_ssh_deadline,
        heartbeat_deadline=settings.install_heartbeat_deadline,
        rescue_device=BootDevice(settings.install_rescue_device))
    return InstallationSettings(
        callback_url=settings.callback_url, image_dir=settings.image_dir,
        stall_timeout=settings.install_stall_timeout, deadline=settings.install_deadline,
        fetch_retries=settings.install_fetch_retries, fetch_stall=settings.install_fetch_stall,
        boot=boot, quarantine_after=settings.install_quarantine_after)


def power_for(settings: Settings, provider: Provider, session: bmdb.Session,
              machine: ProviderMachine) -> PowerControl | None:
    """The machine's power control: its BMC from the inventory (every call under the
    BMC's fleet-wide lock), else its provider's reboot API, else None. Either records
    what it reads and asks in the BMDB (``power.recorder_for``: the web view's power
    column), so Recovery and ``shepherd power`` both leave it."""
    from shepherd import power

    recorder = power.recorder_for(session, provider, machine.provider_id)
    if machine.bmc is not None:
        driver = power.connect(machine.bmc, timeout=settings.bmc_timeout,
                               attempts=settings.bmc_attempts)
        return power.ExclusivePower(driver, session, machine.bmc.lock_name,
                                    wait=settings.bmc_lock_wait, recorder=recorder,
                                    calls_cap=settings.bmc_calls_max)
    if settings.provider in API_PROVIDERS:
        return power.ProviderPower(provider, machine.provider_id, recorder=recorder)
    return None


def bmc_sync_settings(settings: Settings) -> BmcSyncSettings:
    from shepherd.workflows.bmc_sync import SyncSettings

    return SyncSettings(interval=settings.bmc_sync_interval, tick=settings.bmc_sync_tick,
                        calls_cap=settings.bmc_calls_max, reserved=settings.bmc_calls_reserved,
                        slow=settings.bmc_slow, heartbeat_timeout=settings.heartbeat_timeout)


def bmc_driver(settings: Settings) -> Callable[[BmcSpec], BmcControl]:
    """Builds a BMC's bare driver with the settings' timeouts (``power_for`` wraps it)."""
    from shepherd import power

    return lambda spec: power.connect(spec, timeout=settings.bmc_timeout,
                                      attempts=settings.bmc_attempts)


#: The longest an operator's command, page or scrape waits for the callback server.
INTERACTIVE_HEALTHZ_TIMEOUT = 2.0


def guard_limits(settings: Settings, *, interactive: bool = False) -> GuardLimits:
    """The blast-radius guard's limits, one way for workers, CLI, web view and metrics,
    so they pause for the same reasons; ``interactive`` bounds the health check's wait
    (``INTERACTIVE_HEALTHZ_TIMEOUT``) where a person or a scraper is waiting."""
    timeout = settings.healthz_timeout
    return GuardLimits(
        max_share=settings.recovery_max_share, min_silent=settings.recovery_min_silent,
        reboots_per_hour=settings.reboots_per_hour,
        healthz_url=settings.callback_url.rstrip("/") + "/healthz",
        healthz_timeout=min(timeout, INTERACTIVE_HEALTHZ_TIMEOUT) if interactive else timeout,
        healthz_ca_file=settings.callback_ca_file or None,
    )


def provisioner_settings(settings: Settings) -> ProvisionerSettings:
    from shepherd.workflows.provisioner import ProvisionerSettings

    return ProvisionerSettings(
        max_machines=settings.max_machines, chunk_size=settings.chunk_size,
        creation_rate=settings.creation_rate, cooldown=settings.capacity_cooldown,
        assimilate=settings.assimilate,
    )


def sourcing_settings(settings: Settings,
                      process: bmdb.Process = bmdb.Process.AGENT_START) -> SourcingSettings:
    """Sourcing's settings for ``process``: installations have a cap of their own."""
    from shepherd.workflows.sourcing import SourcingSettings

    cap = (settings.install_in_flight_cap if process is bmdb.Process.OS_INSTALL
           else settings.in_flight_cap)
    return SourcingSettings(batch_size=settings.batch_size,
                            in_flight_cap=cap,
                            dispatch_ttl=settings.dispatch_ttl)


def updater_settings(settings: Settings) -> UpdaterSettings:
    from shepherd.workflows.updater import UpdaterSettings

    return UpdaterSettings(batch_size=settings.update_batch_size)


def retention_settings(settings: Settings) -> RetentionSettings:
    """What beat's periodic prune keeps: ``SHEPHERD_HISTORY_RETENTION`` days."""
    from shepherd.workflows.retention import RetentionSettings

    return RetentionSettings(keep=settings.history_keep)
