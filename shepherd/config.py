"""Settings: every knob from ``SHEPHERD_*`` environment variables, with embedded defaults.

One frozen object built once per process (``Settings.from_env()``) by the entry point
(``shepherd serve``, the CLI, a Celery worker or beat, ``shepherd up``), which passes
what is needed down; command-line flags override by building a new one with
``dataclasses.replace`` (which the type checker checks field by field). This module
is the only reader of the environment (with ``shepherd.state_env``, the file a
running ``shepherd up`` leaves beneath it for a second terminal; apart from the agent
and the simulator, which are programs of their own), and nothing reads it at import. Secrets (the
provider API token) come only from the environment or files, never from flags, and
never appear in ``repr``.

Why a hand-written parser rather than pydantic-settings: secrets read from files,
shell-split argument lists, ``initial,maximum,exponent`` backoff triples, percent
shares and ``host:port`` listeners would all be custom validators there anyway, and
it would add a compiled dependency (pydantic-core) to every worker for what is one
table of ``_float``/``_int``/``_bool`` calls whose errors already name the variable.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import bmdb
from shepherd import state_env
from shepherd.redaction import redact_url, url_problem


class SettingsError(ValueError):
    """A SHEPHERD_* variable has a value that cannot be used; the message names it."""


def _get(env: Mapping[str, str], name: str, default: str) -> str:
    return env.get(f"SHEPHERD_{name}", default)


def _url(env: Mapping[str, str], name: str, default: str) -> str:
    """A URL that kombu/Celery parse with ``urllib`` (broker, result backend): refused,
    shown redacted, when they would misread its user info (and print part of it)."""
    value = _get(env, name, default)
    problem = url_problem(value)
    if problem is not None:
        raise SettingsError(f"SHEPHERD_{name}={redact_url(value)!r}: {problem}")
    return value


def _float(env: Mapping[str, str], name: str, default: float, minimum: float = 0.0) -> float:
    raw = _get(env, name, str(default))
    try:
        value = float(raw)
    except ValueError as error:
        raise SettingsError(f"SHEPHERD_{name}={raw!r} is not a number") from error
    if not math.isfinite(value):
        raise SettingsError(f"SHEPHERD_{name}={raw!r} must be a finite number")
    if value < minimum:
        rule = "must not be negative" if minimum == 0 else f"must be at least {minimum:g}"
        raise SettingsError(f"SHEPHERD_{name}={raw!r} {rule}")
    return value


def _int(env: Mapping[str, str], name: str, default: int, minimum: int = 0,
         maximum: int | None = None) -> int:
    raw = _get(env, name, str(default))
    try:
        value = int(raw)
    except ValueError as error:
        raise SettingsError(f"SHEPHERD_{name}={raw!r} is not a whole number") from error
    if value < minimum or (maximum is not None and value > maximum):
        upper = f" and at most {maximum}" if maximum is not None else ""
        raise SettingsError(f"SHEPHERD_{name}={raw!r} must be at least {minimum}{upper}")
    return value


def _port(env: Mapping[str, str], name: str, default: int) -> int:
    """A TCP port, 0 meaning "off" (or "any free one", where a listener takes it)."""
    return _int(env, name, default, minimum=0, maximum=65535)


def parse_listen(value: str) -> tuple[str, int]:
    """``host:port`` (``[::1]:8470``; an empty host is every address) -> (host, port).

    Raises ``ValueError`` with what was wrong; ``Settings`` checks ``SHEPHERD_*_LISTEN``
    with it and ``shepherd serve`` parses its flags with it, so both agree.
    """
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected host:port, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def _listen(env: Mapping[str, str], name: str, default: str) -> str:
    """A ``host:port`` listener; empty only where the default is (meaning "none")."""
    raw = _get(env, name, default).strip()
    if raw or default:
        try:
            parse_listen(raw)
        except ValueError as error:
            raise SettingsError(f"SHEPHERD_{name}={raw!r}: {error}") from error
    return raw


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = _get(env, name, "true" if default else "false").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off", ""):
        return False
    raise SettingsError(f"SHEPHERD_{name}={raw!r} is not a boolean (true/false)")


def _share(env: Mapping[str, str], name: str, default: float) -> float:
    """A fraction in [0, 1]; ``10%`` is accepted too."""
    raw = _get(env, name, str(default)).strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError as error:
        raise SettingsError(f"SHEPHERD_{name}={raw!r} is not a fraction") from error
    if not 0 <= value <= 1:
        raise SettingsError(f"SHEPHERD_{name}={raw!r} must be between 0 and 1 (or 0%..100%)")
    return value


def _args(env: Mapping[str, str], name: str, default: tuple[str, ...]) -> tuple[str, ...]:
    raw = env.get(f"SHEPHERD_{name}")
    if raw is None:
        return default
    try:
        return tuple(shlex.split(raw))
    except ValueError as error:
        raise SettingsError(f"SHEPHERD_{name}={raw!r}: {error}") from error


def _backoff(env: Mapping[str, str], name: str, default: bmdb.Backoff) -> bmdb.Backoff:
    """``SHEPHERD_<NAME>_BACKOFF=initial,maximum,exponent`` (seconds, seconds, factor)."""
    raw = env.get(f"SHEPHERD_{name}_BACKOFF")
    if raw is None:
        return default
    try:
        initial, maximum, exponent = (float(part) for part in raw.split(","))
    except ValueError as error:
        raise SettingsError(
            f"SHEPHERD_{name}_BACKOFF={raw!r}: expected initial,maximum,exponent"
        ) from error
    return bmdb.Backoff(initial=initial, maximum=maximum, exponent=exponent)


MAX_RETENTION_DAYS = 36500


def _retention(env: Mapping[str, str], name: str, default: float) -> float:
    """Days of history to keep: 0 (for ever), or enough to leave the guard its hour (and
    at most a century, so that a cutoff is always a date)."""
    days = _float(env, name, default)
    if days > MAX_RETENTION_DAYS:
        raise SettingsError(f"SHEPHERD_{name}={_get(env, name, '')!r} must be at most "
                            f"{MAX_RETENTION_DAYS} days (0 keeps history for ever)")
    if days:
        try:
            bmdb.history.check_age(dt.timedelta(days=days))
        except ValueError as error:
            raise SettingsError(f"SHEPHERD_{name}={_get(env, name, '')!r} (days): "
                                f"{error}; 0 keeps history for ever") from error
    return days


@dataclass(frozen=True)
class Settings:
    # Where things are.
    bmdb_url: str = "sqlite:///var/bmdb.sqlite"
    # Connections each process keeps to the BMDB (SQLAlchemy pool size).
    bmdb_pool_size: int = 5
    broker_url: str = "sqla+sqlite:///var/broker.sqlite"
    result_backend: str = "db+sqlite:///var/results.sqlite"
    state_dir: Path = Path("var")
    # The provider: "simulator" (default), "equinix" or "static".
    provider: str = "simulator"
    provider_url: str = ""
    provider_project: str = ""
    provider_token: str = field(default="", repr=False)
    static_inventory: str = ""
    # Provider API budget per worker process: seconds between calls, calls in flight.
    provider_min_interval: float = 0.2
    provider_max_in_flight: int = 3
    # SSH port of the provider's machines (the simulator serves every device on one port).
    provider_ssh_port: int = 22
    device_prefix: str = "shepherd-"
    ssh_key_label: str = "shepherd"
    ssh_key_path: Path = Path("var/ssh/shepherd_ed25519")
    # Replace a different key registered under ssh_key_label (a deliberate rotation).
    ssh_key_replace: bool = False
    callback_url: str = "http://127.0.0.1:8080"
    # PEM file of the CA agents verify the callback server against (empty: plain HTTP).
    callback_ca_file: str = ""
    # Intervals (seconds) of what beat schedules.
    reconcile_interval: float = 60.0
    update_interval: float = 60.0
    source_interval: float = 5.0
    sweep_interval: float = 5.0
    # History retention: days of history kept (0: for ever; at least an hour, which the
    # guard's reboot budget reads), and seconds between beat's prunes (0: none).
    history_retention: float = 30.0
    history_prune_interval: float = 600.0
    # Sourcing and handoff.
    batch_size: int = 20
    in_flight_cap: int = 100
    dispatch_ttl: float = 120.0
    # Broker: unacknowledged messages come back after this long (Redis transport);
    # must stay well above the longest task (see ``machine_task_time_limit``).
    visibility_timeout: float = 3600.0
    # Provisioning (reconcile) bounds and updater batches.
    max_machines: int = 100
    chunk_size: int = 10
    creation_rate: float = 1.0
    capacity_cooldown: float = 3600.0
    assimilate: bool = False
    update_batch_size: int = 100
    # Sessions and thresholds.
    session_interval: float = 5.0
    first_heartbeat_timeout: float = 30 * 60.0
    heartbeat_timeout: float = 10 * 60.0
    # SSH.
    ssh_connect_timeout: float = 10.0
    ssh_exec_timeout: float = 60.0
    # The agent: extra command-line arguments (e.g. a short --interval for demos).
    agent_args: tuple[str, ...] = ()
    # Seconds between an agent's heartbeats, sent in its TakeoverInit (0: a tenth of
    # heartbeat_timeout, see ``agent_interval``; an --interval in agent_args wins).
    agent_heartbeat_interval: float = 0.0
    # Recovery: the verified reboot ladder (seconds), quarantine, BMC calls.
    rung_timeout: float = 300.0
    rung_poll_interval: float = 2.0
    boot_wait: float = 300.0
    quarantine_after: int = 3
    bmc_timeout: float = 10.0
    bmc_attempts: int = 3
    # How long a BMC call waits for another worker's call to the same BMC to end.
    bmc_lock_wait: float = 60.0
    # The blast-radius guard; min_silent machines may be silent whatever the share.
    recovery_max_share: float = 0.10
    recovery_min_silent: int = 1
    reboots_per_hour: int = 50
    healthz_timeout: float = 5.0
    # Backoffs.
    agent_start_backoff: bmdb.Backoff = bmdb.backoff.AGENT_START_BACKOFF
    recovery_backoff: bmdb.Backoff = bmdb.backoff.RECOVERY_BACKOFF
    # The callback server (``shepherd serve``; its flags override these).
    serve_listen: str = "127.0.0.1:8470"
    # The web view's own listener ("" = on the agents' listener while that is loopback).
    serve_operator_listen: str = ""
    serve_tls_cert: str = ""
    serve_tls_key: str = ""
    serve_max_body: int = 256 * 1024
    serve_clock_window: float = 60.0
    serve_operator_views: bool = True
    serve_threads: int = 16
    # The callback server's limits against clients on an open network (``shepherd.server.
    # limits``): request head (header lines, bytes: 431 beyond), read deadlines for the
    # head and the body (seconds), open connections, listen backlog, TLS handshake, idle
    # keep-alive; and how long /metrics reuses one computation (seconds).
    serve_max_headers: int = 100
    serve_max_header_bytes: int = 16 * 1024
    serve_header_timeout: float = 10.0
    serve_body_timeout: float = 10.0
    serve_max_connections: int = 1000
    serve_backlog: int = 2048
    serve_tls_handshake_timeout: float = 10.0
    serve_idle_timeout: float = 5.0
    metrics_cache: float = 10.0
    # How long ``shepherd reconcile`` waits for the worker's result.
    reconcile_wait: float = 300.0
    # The worker host's metrics endpoint (0 = none); needs prometheus_multiproc_dir.
    worker_metrics_port: int = 0
    worker_metrics_addr: str = "127.0.0.1"
    # PROMETHEUS_MULTIPROC_DIR (prometheus_client's own name, read by it too): where
    # worker children share their counters; "" = each process counts alone.
    prometheus_multiproc_dir: str = ""

    @property
    def machine_task_time_limit(self) -> float:
        """Hard limit of a per-machine task: SSH connect + run (AgentStart, Recovery's
        agent restart), the whole reboot ladder (four verifications, the boot wait and
        the BMC calls, each of which may wait for the BMC's lock), plus slack.

        Why a limit: a hung task keeps its BMDB session alive, so without one a machine
        could stay held for ever; killing the child ends the session and the sweep
        releases the work (``Abandoned``).
        """
        bmc_call = self.bmc_lock_wait + self.bmc_timeout * self.bmc_attempts
        ladder = 4 * self.rung_timeout + self.boot_wait + 4 * bmc_call
        return self.ssh_connect_timeout + 2 * self.ssh_exec_timeout + ladder + 120.0

    @property
    def machine_task_soft_time_limit(self) -> float:
        """When a per-machine task is asked to stop (``SoftTimeLimitExceeded``).

        Why before the hard limit: the task can still fail its work with a backoff.
        Killed at the hard limit, the work is only released by the sweep
        (``Abandoned``, no backoff) and the same stuck machine is claimed again at once.
        """
        return self.machine_task_time_limit - 30.0

    @property
    def agent_interval(self) -> float:
        """Seconds between an agent's heartbeats: ``agent_heartbeat_interval``, or by
        default a tenth of ``heartbeat_timeout`` (60 s with the defaults).

        Why derived: silence is judged at ``heartbeat_timeout``, so ten heartbeats per
        timeout ride out a few lost ones, and a fleet sends no more than that signal
        needs (100k machines at 5 s would be 20,000 heartbeats/s; at 60 s, ~1,700/s).
        """
        return self.agent_heartbeat_interval or max(0.05, self.heartbeat_timeout / 10)

    @property
    def history_keep(self) -> dt.timedelta | None:
        """How old history must be to be pruned; None keeps it for ever (retention 0)."""
        return dt.timedelta(days=self.history_retention) if self.history_retention else None

    @property
    def thresholds(self) -> bmdb.Thresholds:
        return bmdb.Thresholds(
            first_heartbeat=self.first_heartbeat_timeout, heartbeat=self.heartbeat_timeout
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """From ``env``; by default this process's environment over the settings a
        running ``shepherd up`` left in the state directory (``shepherd.state_env``)."""
        if env is None:
            try:
                env = state_env.environment(os.environ)
            except state_env.StateFileError as error:
                raise SettingsError(str(error)) from None
        d = cls()
        return cls(
            bmdb_url=_get(env, "BMDB_URL", d.bmdb_url),
            bmdb_pool_size=_int(env, "BMDB_POOL_SIZE", d.bmdb_pool_size, minimum=1),
            broker_url=_url(env, "BROKER_URL", d.broker_url),
            result_backend=_url(env, "RESULT_BACKEND", d.result_backend),
            state_dir=Path(_get(env, "STATE_DIR", str(d.state_dir))),
            provider=_get(env, "PROVIDER", d.provider),
            provider_url=_get(env, "PROVIDER_URL", d.provider_url),
            provider_project=_get(env, "PROVIDER_PROJECT", d.provider_project),
            provider_token=_read_secret(env, "PROVIDER_TOKEN"),
            static_inventory=_get(env, "STATIC_INVENTORY", d.static_inventory),
            provider_ssh_port=_int(env, "PROVIDER_SSH_PORT", d.provider_ssh_port, 1, 65535),
            provider_min_interval=_float(env, "PROVIDER_MIN_INTERVAL",
                                         d.provider_min_interval),
            provider_max_in_flight=_int(env, "PROVIDER_MAX_IN_FLIGHT",
                                        d.provider_max_in_flight, minimum=1),
            device_prefix=_get(env, "DEVICE_PREFIX", d.device_prefix),
            ssh_key_label=_get(env, "SSH_KEY_LABEL", d.ssh_key_label),
            ssh_key_path=Path(_get(env, "SSH_KEY_PATH", str(d.ssh_key_path))),
            ssh_key_replace=_bool(env, "SSH_KEY_REPLACE", d.ssh_key_replace),
            callback_url=_get(env, "CALLBACK_URL", d.callback_url),
            callback_ca_file=_get(env, "CALLBACK_CA_FILE", d.callback_ca_file),
            reconcile_interval=_float(env, "RECONCILE_INTERVAL", d.reconcile_interval),
            update_interval=_float(env, "UPDATE_INTERVAL", d.update_interval),
            source_interval=_float(env, "SOURCE_INTERVAL", d.source_interval),
            sweep_interval=_float(env, "SWEEP_INTERVAL", d.sweep_interval),
            history_retention=_retention(env, "HISTORY_RETENTION", d.history_retention),
            history_prune_interval=_float(env, "HISTORY_PRUNE_INTERVAL",
                                          d.history_prune_interval),
            batch_size=_int(env, "BATCH_SIZE", d.batch_size, minimum=1),
            in_flight_cap=_int(env, "IN_FLIGHT_CAP", d.in_flight_cap),
            dispatch_ttl=_float(env, "DISPATCH_TTL", d.dispatch_ttl, minimum=1.0),
            visibility_timeout=_float(env, "VISIBILITY_TIMEOUT", d.visibility_timeout),
            max_machines=_int(env, "MAX_MACHINES", d.max_machines),
            chunk_size=_int(env, "CHUNK_SIZE", d.chunk_size),
            creation_rate=_float(env, "CREATION_RATE", d.creation_rate),
            capacity_cooldown=_float(env, "CAPACITY_COOLDOWN", d.capacity_cooldown),
            assimilate=_bool(env, "ASSIMILATE", d.assimilate),
            update_batch_size=_int(env, "UPDATE_BATCH_SIZE", d.update_batch_size, minimum=1),
            session_interval=_float(env, "SESSION_INTERVAL", d.session_interval, minimum=1.0),
            first_heartbeat_timeout=_float(
                env, "FIRST_HEARTBEAT_TIMEOUT", d.first_heartbeat_timeout
            ),
            heartbeat_timeout=_float(env, "HEARTBEAT_TIMEOUT", d.heartbeat_timeout),
            ssh_connect_timeout=_float(env, "SSH_CONNECT_TIMEOUT", d.ssh_connect_timeout),
            ssh_exec_timeout=_float(env, "SSH_EXEC_TIMEOUT", d.ssh_exec_timeout),
            agent_args=_args(env, "AGENT_ARGS", d.agent_args),
            agent_heartbeat_interval=_float(env, "AGENT_HEARTBEAT_INTERVAL",
                                            d.agent_heartbeat_interval),
            rung_timeout=_float(env, "RUNG_TIMEOUT", d.rung_timeout, minimum=0.1),
            rung_poll_interval=_float(env, "RUNG_POLL_INTERVAL", d.rung_poll_interval,
                                      minimum=0.05),
            boot_wait=_float(env, "BOOT_WAIT", d.boot_wait),
            quarantine_after=_int(env, "QUARANTINE_AFTER", d.quarantine_after, minimum=1),
            bmc_timeout=_float(env, "BMC_TIMEOUT", d.bmc_timeout, minimum=0.1),
            bmc_attempts=_int(env, "BMC_ATTEMPTS", d.bmc_attempts, minimum=1),
            bmc_lock_wait=_float(env, "BMC_LOCK_WAIT", d.bmc_lock_wait),
            recovery_max_share=_share(env, "RECOVERY_MAX_SHARE", d.recovery_max_share),
            recovery_min_silent=_int(env, "RECOVERY_MIN_SILENT", d.recovery_min_silent),
            reboots_per_hour=_int(env, "REBOOTS_PER_HOUR", d.reboots_per_hour),
            healthz_timeout=_float(env, "HEALTHZ_TIMEOUT", d.healthz_timeout),
            agent_start_backoff=_backoff(env, "AGENT_START", d.agent_start_backoff),
            recovery_backoff=_backoff(env, "RECOVERY", d.recovery_backoff),
            serve_listen=_listen(env, "SERVE_LISTEN", d.serve_listen),
            serve_operator_listen=_listen(env, "SERVE_OPERATOR_LISTEN",
                                          d.serve_operator_listen),
            serve_tls_cert=_get(env, "SERVE_TLS_CERT", d.serve_tls_cert),
            serve_tls_key=_get(env, "SERVE_TLS_KEY", d.serve_tls_key),
            serve_max_body=_int(env, "SERVE_MAX_BODY", d.serve_max_body, minimum=1),
            serve_clock_window=_float(env, "SERVE_CLOCK_WINDOW", d.serve_clock_window),
            serve_operator_views=_bool(env, "SERVE_OPERATOR_VIEWS", d.serve_operator_views),
            serve_threads=_int(env, "SERVE_THREADS", d.serve_threads, minimum=1),
            serve_max_headers=_int(env, "SERVE_MAX_HEADERS", d.serve_max_headers, minimum=1),
            serve_max_header_bytes=_int(env, "SERVE_MAX_HEADER_BYTES",
                                        d.serve_max_header_bytes, minimum=256),
            serve_header_timeout=_float(env, "SERVE_HEADER_TIMEOUT", d.serve_header_timeout,
                                        minimum=0.1),
            serve_body_timeout=_float(env, "SERVE_BODY_TIMEOUT", d.serve_body_timeout,
                                      minimum=0.1),
            serve_max_connections=_int(env, "SERVE_MAX_CONNECTIONS", d.serve_max_connections,
                                       minimum=1),
            serve_backlog=_int(env, "SERVE_BACKLOG", d.serve_backlog, minimum=1),
            serve_tls_handshake_timeout=_float(env, "SERVE_TLS_HANDSHAKE_TIMEOUT",
                                               d.serve_tls_handshake_timeout, minimum=0.1),
            serve_idle_timeout=_float(env, "SERVE_IDLE_TIMEOUT", d.serve_idle_timeout,
                                      minimum=0.1),
            metrics_cache=_float(env, "METRICS_CACHE", d.metrics_cache),
            reconcile_wait=_float(env, "RECONCILE_WAIT", d.reconcile_wait),
            worker_metrics_port=_port(env, "WORKER_METRICS_PORT", d.worker_metrics_port),
            worker_metrics_addr=_get(env, "WORKER_METRICS_ADDR", d.worker_metrics_addr),
            prometheus_multiproc_dir=env.get("PROMETHEUS_MULTIPROC_DIR",
                                             d.prometheus_multiproc_dir),
        )


def use_state_dir(directory: Path) -> None:
    """``--state DIR``: this process, and everything it starts, reads its settings
    beneath ``DIR/shepherd.env`` (``shepherd.state_env``)."""
    os.environ[state_env.STATE_DIR_VARIABLE] = str(directory.resolve())


def state_dir() -> Path:
    """The state directory this process reads settings beneath."""
    return state_env.state_dir(os.environ)


def source_of(name: str) -> str | None:
    """Where this process's setting ``name`` comes from, for messages: ``name`` (the
    environment), the state file's path, or None (the embedded default)."""
    if name in os.environ:
        return name
    path = state_env.state_file(os.environ)
    try:
        return str(path) if path.exists() and name in state_env.read(path) else None
    except state_env.StateFileError:
        return None


def environ() -> dict[str, str]:
    """A copy of this process's environment, for ``shepherd up`` to hand its children
    (the one other way the environment is read: passed on whole, not interpreted)."""
    return dict(os.environ)


def _read_secret(env: Mapping[str, str], name: str) -> str:
    """``SHEPHERD_<NAME>`` or the contents of the file named by ``SHEPHERD_<NAME>_FILE``."""
    path = env.get(f"SHEPHERD_{name}_FILE")
    if path:
        try:
            return Path(path).read_text().strip()
        except OSError as error:
            raise SettingsError(f"SHEPHERD_{name}_FILE={path!r}: {error.strerror}") from error
    return env.get(f"SHEPHERD_{name}", "")


def named_secret(name: str) -> str | None:
    """The environment variable ``name`` (an inventory's ``password_env``), read at the
    moment of a BMC call, so the password is never kept in a long-lived object."""
    return os.environ.get(name)
