"""Prometheus metrics: fleet counts and task outcomes from the BMDB, provider API calls.

Two kinds of source, and why each lives where it does:

* **From the BMDB, at scrape time** (``BMDBCollector``): fleet counts
  (``bmdb.fleet_counts``, held machines per kind included), standing reconcile
  refusals (``bmdb.refusals``: the refusal happens in a worker, the alert belongs
  here) and per-machine task outcomes by process (``bmdb.task_outcomes``), and BMDB
  sessions, live and dead but not swept yet (``bmdb.fleet``: counted through the index
  on their deadline). The fleet counts and the outcome totals are counters the BMDB's
  triggers keep in the transaction of every write (docs/ARCHITECTURE.md section 4,
  "Counters"), whoever makes it, so these numbers are fleet-wide and survive worker
  restarts, which in-process counters in Celery children are not. Any process with a BMDB handle can
  serve them; the callback server does at ``/metrics`` on its operators' listener
  (never where only agents should reach it: see ``shepherd.server.asgi``).
* **In the process that calls the provider** (``PROVIDER_CALLS``,
  ``PROVIDER_LATENCY``): counted where the call happens (Celery worker children, or
  whoever uses ``EquinixClient``), labelled by endpoint template and outcome. A
  process's ``/metrics`` shows its own calls. Celery's prefork children are separate
  processes: set ``PROMETHEUS_MULTIPROC_DIR`` (an empty directory, before the worker
  starts) and prometheus_client keeps these in shared files that
  ``worker_registry(dir)`` / ``serve_worker_metrics(...)`` aggregate across children;
  call ``child_exited(pid, dir)`` from the worker's process-shutdown signal. The
  directory is passed in (``Settings.prometheus_multiproc_dir``): nothing here reads
  the environment, and the guard limits of ``server_registry`` are the caller's.

Scrape cost: the BMDB collector reads those counters (no table is counted whole, at
any fleet or history size) in one short transaction per computation, and the server
computes at most once per ``SHEPHERD_METRICS_CACHE`` seconds however many scrape
(``CachedExposition``); a failing BMDB yields
``shepherd_bmdb_up 0`` instead of an error page. The guard
gauges (``shepherd_recovery_*``, ``shepherd_callback_server_healthy``) add one short
read and, when configured, one bounded ``/healthz`` GET; they are absent when the
guard cannot be evaluated.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

import bmdb
from shepherd.workflows.guard import CALLBACK_SERVER, REBOOT_BUDGET, SILENT_SHARE

if TYPE_CHECKING:
    from shepherd.workflows.guard import GuardLimits

log = logging.getLogger(__name__)

#: History events that end a work item, exposed as ``outcome`` labels.
OUTCOMES = bmdb.ENDINGS

PROVIDER_CALLS = Counter(
    "shepherd_provider_api_calls", "Provider API calls made by this process (each HTTP "
    "exchange, retries included), by endpoint template and outcome (ok, 4xx, 5xx, error).",
    ["provider", "endpoint", "outcome"],
)
PROVIDER_LATENCY = Histogram(
    "shepherd_provider_api_call_seconds", "Provider API call latency in seconds (the HTTP "
    "exchange, not the rate limiter's wait), by endpoint template and outcome.",
    ["provider", "endpoint", "outcome"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)

#: Path segments that follow these names are ids: replaced by ``{id}`` so the endpoint
#: label has one value per API operation, not one per device.
_ID_AFTER = frozenset({"projects", "devices", "hardware-reservations", "ssh-keys",
                       "organizations", "facilities", "metros", "ips"})
_UUIDISH = re.compile(r"^[0-9a-fA-F-]{8,}$")


def endpoint_template(method: str, path: str) -> str:
    """``GET /devices/{id}`` from ``GET /devices/3f2a…``: bounded label values."""
    parts = path.split("?", 1)[0].strip("/").split("/")
    out = []
    for i, part in enumerate(parts):
        if i > 0 and (parts[i - 1] in _ID_AFTER or _UUIDISH.match(part)):
            out.append("{id}")
        else:
            out.append(part)
    return f"{method.upper()} /{'/'.join(out)}"


def outcome_of(status: int | None) -> str:
    if status is None:
        return "error"
    if status >= 500:
        return "5xx"
    if status >= 400:
        return "4xx"
    return "ok"


class ProviderCall:
    """What ``provider_call`` measures; the caller sets ``status`` once it has a response."""

    status: int | None = None


@contextlib.contextmanager
def provider_call(method: str, path: str, provider: str = "equinix") -> Iterator[ProviderCall]:
    """Count and time one provider API exchange. No status set (an exception, a
    connection error) counts as ``error``."""
    call = ProviderCall()
    started = time.perf_counter()
    try:
        yield call
    finally:
        labels = (provider, endpoint_template(method, path), outcome_of(call.status))
        PROVIDER_CALLS.labels(*labels).inc()
        PROVIDER_LATENCY.labels(*labels).observe(time.perf_counter() - started)


# -- from the BMDB -----------------------------------------------------------------


class BMDBCollector(Collector):
    """Fleet counts and task outcomes, read from the BMDB on every scrape; with
    ``guard`` limits also the blast-radius guard's view (``guard_metrics``)."""

    def __init__(self, db: bmdb.BMDB, thresholds: bmdb.Thresholds | None = None,
                 guard: GuardLimits | None = None, providers: Iterable[str] = ()) -> None:
        self.db = db
        self.thresholds = thresholds or db.thresholds
        self.guard = guard
        #: Providers whose ``shepherd_reconcile_refusing`` is 0 while they do not refuse
        #: (a series that exists says "checked, fine"); any refusing one is 1 regardless.
        self.providers = tuple(providers)

    def describe(self) -> Iterable[Metric]:
        return []  # names depend on nothing but are read live; skip the describe-time query

    def collect(self) -> Iterable[Metric]:
        up = GaugeMetricFamily("shepherd_bmdb_up", "1 when the BMDB answered this scrape.")
        started = time.perf_counter()
        try:
            counts, outcomes, refusals, sessions, bmcs = self.db.read(
                lambda tx: (bmdb.fleet_counts(tx, self.thresholds),
                            bmdb.task_outcomes(tx), bmdb.current_refusals(tx),
                            SessionFigures.read(tx), bmdb.bmc_sync_counts(tx)))
        except Exception as error:  # a scrape must answer even when the BMDB does not
            log.warning("metrics: BMDB read failed: %s", error)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        took = GaugeMetricFamily("shepherd_bmdb_scrape_seconds",
                                 "Time spent reading the BMDB for this scrape.")
        took.add_metric([], time.perf_counter() - started)
        yield took
        yield from _fleet(counts)
        yield _refusing(refusals, self.providers)
        yield from _outcomes(outcomes)
        yield from _sessions(sessions)
        yield from _bmcs(bmcs)
        if self.guard is not None:
            yield from guard_metrics(self.db, self.thresholds, self.guard)


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, text)
    family.add_metric([], value)
    return family


def _per_process(name: str, text: str, values: dict[str, int]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, text, labels=["process"])
    for process, value in sorted(values.items()):
        family.add_metric([process], value)
    return family


def _fleet(c: bmdb.FleetCounts) -> Iterator[Metric]:
    yield _gauge("shepherd_fleet_machines", "Machines in the BMDB.", c.machines)
    yield _gauge("shepherd_fleet_provided", "Machines with a Provided tag.", c.provided)
    yield _gauge("shepherd_fleet_agent_started", "Machines with AgentStarted.", c.agent_started)
    yield _gauge("shepherd_fleet_heartbeating",
                 "Machines whose last heartbeat is within the heartbeat threshold.",
                 c.heartbeating)
    yield _per_process("shepherd_fleet_backlog",
                       "Machines claimable now, per process (backlog minus work and backoff).",
                       c.backlog)
    yield _per_process("shepherd_fleet_active_work", "Work items held, per process.",
                       c.active_work)
    yield _per_process("shepherd_fleet_active_backoffs", "Backoffs not yet expired, per process.",
                       c.active_backoffs)
    held = GaugeMetricFamily("shepherd_machines_held", "Machines held out of every backlog, "
                             "per kind (maintenance: an operator's; quarantine: the reboot "
                             "ladder failed too often; host-key: a takeover met another "
                             "host key than the pin; bmc-mismatch: its BMC manages another "
                             "system).", labels=["kind"])
    for kind, count in sorted(c.held.items()):
        held.add_metric([kind], count)
    yield held


def _bmcs(counts: bmdb.BmcSyncCounts) -> Iterator[Metric]:
    """What the power and health sync's last reads found wrong: BMCs by status (a
    sample per status, 0 included, so an alert can tell "none" from "not scraped"),
    and BMCs that say Off while their machine's agent heartbeats."""
    family = GaugeMetricFamily(
        "shepherd_bmcs_not_answering", "Machines whose BMC did not answer the power and "
        "health sync's last read, by status (unreachable, auth-refused, failing; slow: "
        "answered late). Recovery only restarts agents behind the first three.",
        labels=["status"])
    for status, count in sorted(counts.by_status.items()):
        family.add_metric([status], count)
    yield family
    yield _gauge("shepherd_bmc_contradictions", "Machines whose BMC said Off at the sync's "
                 "last read while their agent heartbeated: usually a BMC wired to "
                 "another machine.", counts.contradictions)


def _refusing(refusals: Iterable[bmdb.Refusal], providers: Iterable[str]
              ) -> GaugeMetricFamily:
    """1 per provider whose last reconcile refused to act (the fleets disagree), 0 for
    the ``providers`` named that do not. The cause (with the setting that resolves it)
    is in ``shepherd fleet`` and the web view: label values stay bounded."""
    refusing = {r.provider for r in refusals}
    family = GaugeMetricFamily("shepherd_reconcile_refusing", "1 while the provider's "
                               "reconcile refuses to act (FLEET MISMATCH: see `shepherd "
                               "fleet` for what resolves it).", labels=["provider"])
    for provider in sorted(refusing | set(providers)):
        family.add_metric([provider], int(provider in refusing))
    return family


def _outcomes(outcomes: dict[tuple[str, str], int]) -> Iterator[Metric]:
    started = CounterMetricFamily(
        "shepherd_machine_tasks_started", "Per-machine work items started (claimed), per "
        "process, fleet-wide (BMDB history).", labels=["process"])
    ended = CounterMetricFamily(
        "shepherd_machine_task_outcomes", "Per-machine work items ended, per process and "
        "outcome (Finished, Failed, Canceled, Abandoned), fleet-wide (BMDB history).",
        labels=["process", "outcome"])
    for (process, event), count in sorted(outcomes.items()):
        if event == bmdb.Event.STARTED:
            started.add_metric([process], count)
        elif event in OUTCOMES:
            ended.add_metric([process, event], count)
    yield started
    yield ended


@dataclass(frozen=True)
class SessionFigures:
    """BMDB sessions as the sweep sees them (``bmdb.fleet``, read through the index
    on their deadline): the live ones, and the dead ones still in the table with the
    work they hold (machines no claim can take until the sweep releases them)."""

    alive: int
    dead: bmdb.DeadSessions
    #: Seconds since the oldest dead session's deadline passed; 0 with none dead.
    oldest_dead_seconds: float

    @classmethod
    def read(cls, tx: bmdb.Tx) -> SessionFigures:
        dead = bmdb.dead_sessions(tx)
        oldest = dead.oldest_deadline or tx.now
        return cls(alive=bmdb.alive_sessions(tx), dead=dead,
                   oldest_dead_seconds=max(0.0, (tx.now - oldest).total_seconds()))


def _sessions(figures: SessionFigures) -> Iterator[Metric]:
    """Why: a dead session's work blocks its machines until the sweep releases it, so a
    dead session that stays is the sign of a sweep that does not run."""
    yield _gauge("shepherd_sessions_alive", "BMDB sessions whose deadline has not passed "
                 "(one per live worker or server process).", figures.alive)
    yield _gauge("shepherd_sessions_dead", "BMDB sessions past their deadline that the "
                 "sweep has not deleted yet.", figures.dead.sessions)
    yield _gauge("shepherd_sessions_dead_work", "Work items held by dead sessions: their "
                 "machines are in no backlog until the sweep releases them.",
                 figures.dead.work)
    yield _gauge("shepherd_sessions_oldest_dead_seconds", "Seconds since the deadline of "
                 "the oldest dead session still in the BMDB passed (0: none); grows while "
                 "the sweep does not run.", figures.oldest_dead_seconds)


# -- the blast-radius guard ------------------------------------------------------

#: Why Recovery may be paused, as bounded label values (the guard's own labels).
PAUSE_REASONS = (SILENT_SHARE, CALLBACK_SERVER, REBOOT_BUDGET)

RECOVERY_PAUSES = Counter(
    "shepherd_recovery_pauses", "Times this process's sourcing or Recovery task found the "
    "blast-radius guard pausing Recovery, by reason. Counted where the decision is taken, "
    "so it shows on the worker's endpoint even while the callback server (whose /metrics "
    "has the guard gauges) is the thing that is down.", ["reason"],
)


def count_recovery_pause(causes: Iterable[str]) -> None:
    for cause in causes:
        RECOVERY_PAUSES.labels(reason=cause).inc()


# -- installations ---------------------------------------------------------------
# In flight: ``shepherd_fleet_active_work{process="ShepherdOSInstall"}``; ended, by
# outcome: ``shepherd_machine_task_outcomes`` (both from the BMDB, fleet-wide).

INSTALLATION_SECONDS = Histogram(
    "shepherd_installation_seconds", "Installations this process watched, from the claim "
    "to the outcome, by outcome.", ["outcome"],
    buckets=(30, 60, 120, 300, 600, 900, 1200, 1800, 3600, float("inf")))
INSTALLATION_FAILURES = Counter(
    "shepherd_installation_failures", "Installations that failed, by cause (the agent's "
    "cause kind: digest, read_back, fetch, stall, refused, agent_silent...).", ["cause"])


def count_installation(outcome: str, seconds: float, cause: str | None) -> None:
    INSTALLATION_SECONDS.labels(outcome=outcome).observe(seconds)
    if outcome == "failed":
        INSTALLATION_FAILURES.labels(cause=cause or "other").inc()


def guard_metrics(db: bmdb.BMDB, thresholds: bmdb.Thresholds,
                  limits: GuardLimits) -> Iterator[Metric]:
    """What ``guard.evaluate`` decides now, as gauges; nothing when it cannot be read.

    Why at scrape time: the decision is a function of the BMDB (and the callback
    server's health) at this moment, which no worker counter could track. Cost: one
    short read transaction plus, with ``limits.healthz_url``, one GET bounded by
    ``limits.healthz_timeout``. A failure leaves these gauges out (an absent series,
    not a false "not paused"); ``shepherd_bmdb_up`` says whether the BMDB answered.
    """
    from shepherd.workflows import guard

    try:
        decision = guard.evaluate(db, thresholds, limits)
    except Exception as error:  # a scrape must answer even when the guard cannot
        log.warning("metrics: guard evaluation failed: %s", error)
        return
    yield _gauge("shepherd_recovery_paused",
                 "1 when the blast-radius guard pauses Recovery (reboots nothing) now.",
                 int(decision.paused is not None))
    paused = GaugeMetricFamily(
        "shepherd_recovery_pause_reason",
        "1 for each reason the guard pauses Recovery now: silent_share, callback_server, "
        "reboot_budget.", labels=["reason"])
    for reason in PAUSE_REASONS:
        paused.add_metric([reason], int(reason in decision.causes))
    yield paused
    yield _gauge("shepherd_recovery_agents_started",
                 "Machines with AgentStarted, the guard's denominator.", decision.started)
    yield _gauge("shepherd_recovery_silent",
                 "Distinct machines in the Recovery backlog query (silent agents), backing "
                 "off or held ones included.", decision.silent)
    yield _gauge("shepherd_recovery_reboots_last_hour",
                 "Recovery claims in the last hour, fleet-wide (the hourly budget spent).",
                 decision.reboots_last_hour)
    yield _gauge("shepherd_recovery_reboots_allowed",
                 "Recovery claims the hourly reboot budget still admits.", decision.allowed)
    if decision.callback_healthy is not None:
        yield _gauge("shepherd_callback_server_healthy",
                     "1 when the agent callback server answered /healthz with 200 (as seen "
                     "through the agents' endpoint).", int(decision.callback_healthy))


# -- registries and exposition -------------------------------------------------------


class _ProcessMetrics(Collector):
    """This process's own metrics (the default registry: provider calls, process and
    Python runtime), folded into another registry."""

    def collect(self) -> Iterable[Metric]:
        return REGISTRY.collect()


def process_collector(registry: CollectorRegistry, multiproc_dir: str | None) -> None:
    """Add this process's metrics to ``registry``: aggregated over every process sharing
    ``multiproc_dir`` (``Settings.prometheus_multiproc_dir``) when given, else this
    process's default registry."""
    if multiproc_dir:
        from prometheus_client import multiprocess

        multiprocess.MultiProcessCollector(registry, path=multiproc_dir)
    else:
        registry.register(_ProcessMetrics())


def server_registry(db: bmdb.BMDB, limits: GuardLimits | None, *,
                    thresholds: bmdb.Thresholds | None = None,
                    multiproc_dir: str | None = None,
                    providers: Iterable[str] = ()) -> CollectorRegistry:
    """What the callback server's ``/metrics`` shows: BMDB metrics, the guard gauges
    when ``limits`` are given (the server's own, so they match its web view), plus its
    process's. ``providers``: the configured provider(s), whose refusal gauge reads 0
    while they do not refuse."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BMDBCollector(db, thresholds, limits, providers))
    process_collector(registry, multiproc_dir)
    return registry


def worker_registry(multiproc_dir: str | None) -> CollectorRegistry:
    """What a worker host's endpoint shows: provider calls of all its processes (with
    ``multiproc_dir``; without it, only this process's)."""
    registry = CollectorRegistry(auto_describe=False)
    process_collector(registry, multiproc_dir)
    return registry


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The text format and its content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


class CachedExposition:
    """``exposition`` of one registry, computed at most once per ``max_age`` seconds and
    by one thread at a time, whatever the number of scrapers (single flight).

    Why: each computation is a BMDB transaction and, with guard limits, a health
    check over HTTP; scrapers are many and concurrent, and each computing its own
    would hold a BMDB connection and a thread apiece. A scraper arriving while a
    computation runs waits for that one and gets its result; one arriving later gets
    the cached text until it is ``max_age`` old (0: each scrape computes, still one
    at a time). ``registry`` is a factory, called once at the first scrape, so that
    nothing touches the BMDB before someone asks.
    """

    def __init__(self, registry: Callable[[], CollectorRegistry], max_age: float) -> None:
        self._factory = registry
        self._registry: CollectorRegistry | None = None
        self.max_age = max_age
        self._lock = threading.Condition()
        self._computing = False
        self._generation = 0
        self._value: tuple[bytes, str] | None = None
        self._at = 0.0
        #: Computations done (what the tests count).
        self.computed = 0

    def get(self) -> tuple[bytes, str]:
        with self._lock:
            if self._value is not None and time.monotonic() - self._at < self.max_age:
                return self._value
            if self._computing:
                generation = self._generation
                self._lock.wait_for(lambda: not self._computing)
                if self._generation != generation and self._value is not None:
                    return self._value  # the computation we waited for
            self._computing = True
        value = None
        try:
            if self._registry is None:
                self._registry = self._factory()
            value = exposition(self._registry)
            return value
        finally:
            with self._lock:
                self._computing = False
                if value is not None:
                    self._value, self._at = value, time.monotonic()
                    self._generation += 1
                    self.computed += 1
                self._lock.notify_all()


def serve_worker_metrics(port: int, addr: str, multiproc_dir: str) -> Any:
    """Serve ``worker_registry(multiproc_dir)`` on ``addr:port`` from a daemon thread (call
    it in the worker's main process; returns prometheus_client's server and thread)."""
    from prometheus_client import start_http_server

    return start_http_server(port, addr=addr, registry=worker_registry(multiproc_dir))


def child_exited(pid: int, multiproc_dir: str | None) -> None:
    """Tell multiprocess mode a worker child is gone (its gauges stop counting)."""
    if multiproc_dir:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, path=multiproc_dir)
