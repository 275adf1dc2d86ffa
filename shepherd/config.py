"""Settings: every knob from ``SHEPHERD_*`` environment variables, with embedded defaults.

One frozen object built once per process (``Settings.from_env()``) by the entry point
(``shepherd serve``, the CLI, a Celery worker or beat, ``shepherd up``), which passes
what is needed down; command-line flags override by building a new one with
``dataclasses.replace`` (which the type checker checks field by field). This module
is the only reader of the environment (with ``shepherd.state_env``, the file a
running ``shepherd up`` leaves beneath it for a second terminal; apart from the agent
and the simulator, which are programs of their own), and nothing reads it at import.
Secrets (the provider API token) come only from the environment or files, never from
flags, and never appear in ``repr`` or in an error.

Each setting is said once, below: its field's name gives the variable
(``batch_size`` is ``SHEPHERD_BATCH_SIZE``), and ``setting()`` gives its default,
help, bounds and kind (``shepherd.config_kinds``). ``from_env``, the README's table
(``settings_table``, checked by ``tests/project/test_config.py``) and the check of the
CLI's help texts read that declaration.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bmdb
from shepherd import state_env
from shepherd.config_kinds import (
    Refused,
    Spec,
    listen,
    number,
    optional_listen,
    rescue_device,
    setting,
    share,
    shown_default,
    spec_of,
    url,
)
from shepherd.config_kinds import parse_listen as parse_listen

MAX_RETENTION_DAYS = 36500
MINUTE = 60.0


class SettingsError(ValueError):
    """A SHEPHERD_* variable has a value that cannot be used; the message names it."""


def retention(raw: str, spec: Spec) -> float:
    """Days of history to keep: 0 (for ever), or enough to leave the guard its hour (and
    at most a century, so that a cutoff is always a date)."""
    days = number(raw, spec)
    if days > MAX_RETENTION_DAYS:
        raise Refused(f" must be at most {MAX_RETENTION_DAYS} days (0 keeps history for ever)")
    if days:
        try:
            bmdb.check_prune_age(dt.timedelta(days=days))
        except ValueError as error:
            raise Refused(f" (days): {error}; 0 keeps history for ever") from None
    return days


@dataclass(frozen=True)
class Settings:
    # Where things are.
    bmdb_url: str = setting("sqlite:///var/bmdb.sqlite", "the BMDB (SQLAlchemy URL)")
    bmdb_pool_size: int = setting(5, "connections each process keeps to the BMDB", minimum=1)
    broker_url: str = setting("sqla+sqlite:///var/broker.sqlite", "Celery's broker",
                              kind=url)
    result_backend: str = setting("db+sqlite:///var/results.sqlite",
                                  "Celery's result backend", kind=url)
    state_dir: Path = setting(Path("var"), "where `shepherd up` keeps its state, and "
                              "where every process finds the shepherd.env it left")
    # The provider.
    provider: str = setting("simulator", "where machines come from: simulator, equinix "
                            "or static")
    provider_url: str = setting("", "the provider's API (simulator, equinix)")
    provider_project: str = setting("", "the provider's project (simulator, equinix)")
    provider_token: str = setting("", "the provider's API token", secret=True)
    static_inventory: str = setting("", "the inventory file (provider static)")
    provider_min_interval: float = setting(
        0.2, "seconds between a worker process's provider API calls")
    provider_max_in_flight: int = setting(
        3, "provider API calls a worker process has in flight at once", minimum=1)
    provider_ssh_port: int = setting(
        22, "SSH port of the provider's machines (the simulator serves all on one)",
        minimum=1, maximum=65535)
    device_prefix: str = setting("shepherd-", "name prefix of the devices Shepherd creates")
    ssh_key_label: str = setting("shepherd", "the label of the fleet's SSH key at the "
                                 "provider")
    ssh_key_path: Path = setting(Path("var/ssh/shepherd_ed25519"),
                                 "the fleet's SSH private key (the same on every worker)")
    ssh_key_replace: bool = setting(False, "replace a different key registered under "
                                    "the label (a deliberate rotation)")
    # Where agents call back.
    callback_url: str = setting("http://127.0.0.1:8080", "the callback server's URL, as "
                                "machines reach it", old_names=("SHEPHERD_BMAAS_ENDPOINT",))
    callback_ca_file: str = setting("", "PEM file of the CA agents verify the callback "
                                    "server against (empty: plain HTTP)",
                                    old_names=("SHEPHERD_BMAAS_CA_FILE",))
    # What beat schedules (seconds between runs).
    reconcile_interval: float = setting(60.0, "seconds between reconciles")
    update_interval: float = setting(60.0, "seconds between provider updates")
    source_interval: float = setting(5.0, "seconds between sourcings (a full batch is "
                                     "followed by the next at once)")
    sweep_interval: float = setting(5.0, "seconds between sweeps of dead sessions")
    history_retention: float = setting(30.0, "days of history kept (0: for ever; at "
                                       "least an hour, which the guard reads)",
                                       kind=retention)
    history_prune_interval: float = setting(600.0, "seconds between history prunes "
                                            "(0: none)")
    # Sourcing and handoff.
    batch_size: int = setting(20, "machines a sourcing dispatches per run", minimum=1)
    in_flight_cap: int = setting(100, "claims handed to workers and not yet adopted, at "
                                 "most")
    dispatch_ttl: float = setting(120.0, "seconds a worker has to adopt a claim",
                                  minimum=1.0)
    visibility_timeout: float = setting(3600.0, "seconds after which the broker hands an "
                                        "unacknowledged task out again (Redis); above "
                                        "the longest task")
    # Reconcile and update.
    max_machines: int = setting(100, "machines reconcile grows the fleet to, at most")
    chunk_size: int = setting(10, "creation attempts per reconcile, at most")
    creation_rate: float = setting(1.0, "creations per second (0: as fast as the provider "
                                   "answers)")
    capacity_cooldown: float = setting(3600.0, "seconds a capacity that failed is left "
                                       "alone")
    assimilate: bool = setting(False, "register the provider's machines that Shepherd "
                               "did not create")
    update_batch_size: int = setting(100, "machines an update changes per transaction",
                                     minimum=1)
    # Sessions and thresholds.
    session_interval: float = setting(5.0, "seconds between a process's BMDB session "
                                      "renewals", minimum=1.0)
    first_heartbeat_timeout: float = setting(30 * MINUTE, "seconds a started agent has "
                                             "for its first heartbeat")
    heartbeat_timeout: float = setting(10 * MINUTE, "seconds of silence after which a "
                                       "machine is stale (and recovered)")
    # SSH and the agent.
    ssh_connect_timeout: float = setting(10.0, "seconds an SSH connection may take")
    ssh_exec_timeout: float = setting(60.0, "seconds an SSH command may take")
    agent_args: tuple[str, ...] = setting((), "extra arguments of the agent (shell "
                                          "words, e.g. --interval 2 for demos)")
    agent_heartbeat_interval: float = setting(0.0, "seconds between an agent's "
                                              "heartbeats (0: a tenth of the heartbeat "
                                              "timeout)")
    # Recovery: the verified reboot ladder, quarantine, BMC calls, the guard.
    rung_timeout: float = setting(300.0, "seconds each rung of the reboot ladder waits "
                                  "to see its effect", minimum=0.1)
    rung_poll_interval: float = setting(2.0, "seconds between a rung's checks",
                                        minimum=0.05)
    boot_wait: float = setting(300.0, "seconds a power-cycled machine has to come back")
    quarantine_after: int = setting(3, "exhausted ladders before a machine is "
                                    "quarantined", minimum=1)
    bmc_timeout: float = setting(10.0, "seconds a BMC call may take", minimum=0.1)
    bmc_attempts: int = setting(3, "tries of a BMC call", minimum=1)
    bmc_lock_wait: float = setting(60.0, "seconds a BMC call waits for another worker's "
                                   "call to the same BMC, or for a free call slot")
    bmc_calls_max: int = setting(16, "BMC calls in flight fleet-wide, at most (Recovery, "
                                 "shepherd power and installations share them)",
                                 minimum=1, maximum=1024)
    bmc_calls_reserved: int = setting(4, "of those, the slots the power and health sync "
                                      "leaves to Recovery, shepherd power and "
                                      "installations", minimum=0, maximum=1023)
    bmc_sync_interval: float = setting(300.0, "seconds between two reads of a machine's "
                                       "BMC by the power and health sync, at least (0: "
                                       "no sync)")
    bmc_sync_tick: float = setting(10.0, "seconds between the sync's runs, and how long "
                                   "one run starts reads", minimum=1.0)
    bmc_slow: float = setting(5.0, "seconds after which a BMC's answer counts as slow",
                              minimum=0.1)
    recovery_max_share: float = setting(0.10, "share of the fleet that may be silent "
                                        "before Recovery pauses (0.1 or 10%)", kind=share)
    recovery_min_silent: int = setting(1, "machines that may be silent whatever the share")
    reboots_per_hour: int = setting(50, "Recovery starts per hour, at most")
    healthz_timeout: float = setting(5.0, "seconds the guard waits for the callback "
                                     "server's /healthz")
    agent_start_backoff: bmdb.Backoff = setting(
        bmdb.AGENT_START_BACKOFF, "AgentStart's backoff: initial,maximum,exponent "
        "(seconds, seconds, factor)")
    recovery_backoff: bmdb.Backoff = setting(
        bmdb.RECOVERY_BACKOFF, "Recovery's backoff: initial,maximum,exponent")
    # Installing operating systems (``shepherd install``, README "Installing an
    # operating system").
    image_dir: Path = setting(Path("var/images"), "Shepherd's image directory: the "
                              "catalog (catalog.toml) and the image files `shepherd "
                              "serve` serves to agents")
    install_in_flight_cap: int = setting(20, "installations in flight fleet-wide, at most",
                                         minimum=1)
    install_stall_timeout: float = setting(300.0, "seconds an installing agent may go "
                                           "without reporting progress", minimum=1.0)
    install_deadline: float = setting(1800.0, "seconds an installation may take up to its "
                                      "verified write, a rescue boot included (below the "
                                      "visibility timeout)", minimum=1.0)
    install_fetch_retries: int = setting(5, "times an agent resumes a broken image "
                                         "download")
    install_fetch_stall: float = setting(30.0, "seconds an image download may go without "
                                         "a byte before it is resumed", minimum=0.1)
    install_backoff: bmdb.Backoff = setting(
        bmdb.INSTALL_BACKOFF, "a failed installation's backoff: initial,maximum,exponent")
    install_ssh_deadline: float = setting(300.0, "seconds from power on to the SSH banner "
                                          "of the system an installation boots", minimum=1.0)
    install_heartbeat_deadline: float = setting(120.0, "seconds from the takeover of a "
                                                "booted system to its agent's first "
                                                "heartbeat", minimum=1.0)
    install_quarantine_after: int = setting(3, "installations failed in a row before the "
                                            "machine is quarantined", minimum=1)
    install_rescue_device: str = setting("network", "what boots the rescue system for an "
                                         "installation: network or cd (virtual media)",
                                         kind=rescue_device)
    # The callback server (``shepherd serve``; its flags override these).
    serve_listen: str = setting("127.0.0.1:8470", "the agents' listener (host:port)",
                                kind=listen)
    serve_operator_listen: str = setting("", "the web view's own listener (empty: on the "
                                         "agents' listener while that is loopback)",
                                         kind=optional_listen)
    serve_tls_cert: str = setting("", "the callback server's TLS certificate (PEM)")
    serve_tls_key: str = setting("", "its private key (PEM)")
    serve_operator_tls_cert: str = setting("", "the operators' listener's TLS certificate "
                                           "(PEM; empty: the agents' listener's)")
    serve_operator_tls_key: str = setting("", "its private key (PEM)")
    serve_login_required: bool = setting(False, "the web view's pages need a login on a "
                                         "loopback listener too (elsewhere they always "
                                         "do)")
    serve_login_failures: int = setting(10, "refused tokens a client address may send per "
                                        "minute before the operators' API and login "
                                        "refuse it for a minute", minimum=1)
    serve_max_body: int = setting(256 * 1024, "bytes of a request body, at most", minimum=1)
    serve_clock_window: float = setting(60.0, "seconds a heartbeat's timestamp may differ from "
                                        "the server's clock")
    serve_operator_views: bool = setting(True, "serve the web view (/machines, /sessions)")
    # Two writers, not more: batches grow while both are busy, and every further
    # writer thread fights the event loop for the GIL at each of its round trips
    # (bench/heartbeat_ingest.py: 4 writers took a third fewer heartbeats a second
    # than 2, at more CPU each; 1 writer fewer again).
    serve_threads: int = setting(2, "heartbeat batches written at once (each a thread "
                                 "and a BMDB connection)", minimum=1)
    serve_batch_window: float = setting(0.003, "seconds a heartbeat waits for others to "
                                        "share its BMDB transaction (group commit)",
                                        minimum=0.0)
    # Limits against clients on an open network (``shepherd.server.limits``).
    serve_max_headers: int = setting(100, "header lines of a request, at most (431 "
                                     "beyond)", minimum=1)
    serve_max_header_bytes: int = setting(16 * 1024, "bytes of a request head, at most",
                                          minimum=256)
    serve_header_timeout: float = setting(10.0, "seconds a client has to send a request's "
                                          "head", minimum=0.1)
    serve_body_timeout: float = setting(10.0, "seconds a client has to send a body",
                                        minimum=0.1)
    serve_max_connections: int = setting(1000, "open connections, at most", minimum=1)
    serve_backlog: int = setting(2048, "the listen backlog", minimum=1)
    serve_tls_handshake_timeout: float = setting(10.0, "seconds a TLS handshake may take",
                                                 minimum=0.1)
    serve_idle_timeout: float = setting(5.0, "seconds an idle keep-alive connection is "
                                        "kept", minimum=0.1)
    metrics_cache: float = setting(10.0, "seconds /metrics reuses one computation")
    # The CLI and the workers' metrics.
    reconcile_wait: float = setting(300.0, "seconds `shepherd reconcile` waits for the "
                                    "worker's result")
    worker_metrics_port: int = setting(0, "port of a worker host's metrics (0: none; "
                                       "needs PROMETHEUS_MULTIPROC_DIR)", maximum=65535)
    worker_metrics_addr: str = setting("127.0.0.1", "address of a worker host's metrics")
    prometheus_multiproc_dir: str = setting(
        "", "where worker children share their counters (prometheus_client's own "
        "variable; empty: each process counts alone)", variable="PROMETHEUS_MULTIPROC_DIR")

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
    def install_task_time_limit(self) -> float:
        """Hard limit of an installation task: the workflow ends each step at its deadline
        (``install_deadline`` up to the verified write, a rescue boot included; then the
        installed system's boot: a power off and on, the SSH banner, the first
        heartbeat); this is the backstop, with room to fail the work with its cause."""
        return (self.install_deadline + self.rung_timeout * 2 + self.install_ssh_deadline
                + self.install_heartbeat_deadline + 300.0)

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
        values: dict[str, Any] = {}
        for declared in dataclasses.fields(cls):
            value = _read(env, declared)
            if value is not _UNSET:
                values[declared.name] = value
        return cls(**values)


_UNSET = object()


def _read(env: Mapping[str, str], declared: dataclasses.Field[object]) -> object:
    """The value of one setting's variable (its first name set), or ``_UNSET``."""
    spec = spec_of(declared)
    for name in spec.names(declared.name):
        if spec.secret and env.get(f"{name}_FILE"):
            return _read_secret_file(f"{name}_FILE", env[f"{name}_FILE"])
        if name in env:
            raw = env[name]
            try:
                return spec.kind(raw, spec)
            except Refused as refused:
                shown = "(hidden)" if spec.secret else repr(
                    raw if refused.shown is None else refused.shown)
                raise SettingsError(f"{name}={shown}{refused.problem}") from None
    return _UNSET


def _read_secret_file(variable: str, path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as error:
        raise SettingsError(f"{variable}={path!r}: {error.strerror}") from None


def declared() -> Iterator[tuple[str, Spec, object]]:
    """``(field name, declaration, default)`` of every setting, in declaration order."""
    for one in dataclasses.fields(Settings):
        yield one.name, spec_of(one), one.default


def variables() -> dict[str, str]:
    """Every variable ``Settings`` reads (former names too) -> its field's name."""
    found = {}
    for name, spec, _ in declared():
        names = spec.names(name)
        for variable in (*names, *([f"{names[0]}_FILE"] if spec.secret else [])):
            found[variable] = name
    return found


def settings_table() -> str:
    """The README's table of settings (Markdown), from the declaration."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for name, spec, default in declared():
        variable, *old = spec.names(name)
        also = [f"`{variable}_FILE` (a file holding it)"] if spec.secret else []
        also += [f"`{former}` (former name)" for former in old]
        meaning = spec.help + (f"; also {', '.join(also)}" if also else "")
        shown = shown_default(default)
        rows.append(f"| `{variable}` | {f'`{shown}`' if shown else ''} "
                    f"| {meaning}{_bounds(spec)} |")
    return "\n".join(rows) + "\n"


def _bounds(spec: Spec) -> str:
    if spec.minimum is None and spec.maximum is None:
        return ""
    lower = f"at least {spec.minimum:g}" if spec.minimum is not None else ""
    upper = f"at most {spec.maximum:g}" if spec.maximum is not None else ""
    return f" ({', '.join(part for part in (lower, upper) if part)})"


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


def named_secret(name: str) -> str | None:
    """The environment variable ``name`` (an inventory's ``password_env``), read at the
    moment of a BMC call, so the password is never kept in a long-lived object."""
    return os.environ.get(name)
