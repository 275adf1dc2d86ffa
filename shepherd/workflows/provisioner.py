"""Reconcile: bring the provider's machines and the BMDB into step, then create more.

Plain Python, no Celery: a periodic task calls ``reconcile(session, provider, settings)``.

The safety rails (docs/ARCHITECTURE.md section 5) and why they exist:

* **The two fleets must agree before anything is created.** A device with our prefix
  that the BMDB lacks, or a BMDB machine the provider does not list, means someone
  (or a crash between a create and its registration) changed the fleet behind our back.
  Creating more on top of a fleet we do not understand is how whole racks get
  double-provisioned, so the run stops with ``FleetMismatch`` (logged at ERROR with
  the ids) and touches nothing. The opt-in ``assimilate`` setting registers the
  provider-only machines instead; BMDB-only machines always stop the run, because
  only an operator can tell "deleted on purpose" from "lost". The refusal is kept
  in the BMDB (``bmdb.refusals``) until a run goes through, so ``shepherd fleet``,
  the web view, ``shepherd up`` and the metrics show it, naming the setting.
* **An authoritative provider (a static inventory) is the fleet.** The file is the
  operator's statement of which machines exist: what it lists is registered without
  any setting, and a machine it no longer lists is left to the updater, which marks
  it Missing (shown as gone, never deleted, never started).
* **No provider call inside a transaction.** A transaction body may run more than
  once and must have no outside effects, and on SQLite an open transaction holds the
  database's write lock: every listing and every create happens between
  transactions, and a created machine is registered afterwards in a transaction of
  its own.
* **Our own interrupted creations are not strangers.** That gap between "created"
  and "registered" is covered by the creation intent: it is committed before the
  provider is asked (``bmdb.record_intent``) and deleted in the same
  transaction as the registration. A provider-only machine whose witness matches a
  pending intent was made by a creator that died (or lost its answer) before it
  could register it: it is registered, with a warning, instead of stopping the run.
* **Every run is bounded**: at most ``chunk_size`` creation attempts, never more than
  ``max_machines`` machines of this provider in total, creations spaced by
  ``1 / creation_rate`` seconds.
* **Failed capacity sits out** (``cooldown``, an hour by default), recorded in the BMDB
  (``bmdb.capacity``) because the next run may happen in another worker process.
* **Nothing partial on a provider outage**: listing errors propagate as the provider's
  typed error (``TransientExhausted``, ``PermanentError``...) before any write.
* **One reconcile at a time**, fleet-wide (the hold ``RECONCILE_HOLD``, taken here
  like sourcing takes its own): two runs at once could each create a chunk and
  overshoot ``max_machines``, and beat may send reconcile twice (two beats, a backed-up
  queue, an operator's ``shepherd reconcile``). A run that finds the hold taken returns
  at once with ``busy=True``.
* Placeholder device prefixes and SSH key labels are refused when the provider is
  constructed (``refuse_placeholder`` in ``shepherd.providers``); the settings here
  are validated when they are built.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import bmdb
from shepherd.providers.base import (
    Capacity,
    Provider,
    ProviderError,
    ProviderMachine,
    TransientExhausted,
    refuse_placeholder,
    register_provided,
)
from shepherd.workflows.common import MAX_CAUSE

log = logging.getLogger(__name__)

#: How many ids a FleetMismatch message and log line show; the exception keeps all.
SHOWN_IDS = 20
#: The fleet-wide hold a reconcile runs under, and what a run that met it says.
RECONCILE_HOLD = "reconcile"
SKIPPED = "reconcile already running"


class FleetMismatch(Exception):
    """The provider and the BMDB disagree about which machines exist: nothing was created."""

    def __init__(self, provider: str, provider_only: Iterable[str],
                 bmdb_only: Iterable[str]) -> None:
        self.provider = provider
        self.provider_only = sorted(provider_only)
        self.bmdb_only = sorted(bmdb_only)
        super().__init__(
            f"provider {provider!r} and the BMDB disagree; refusing to provision: "
            f"{len(self.provider_only)} at the provider but not in the BMDB "
            f"{_shown(self.provider_only)}, {len(self.bmdb_only)} in the BMDB but not at "
            f"the provider {_shown(self.bmdb_only)}"
        )

    @property
    def advice(self) -> str:
        """The refusal as operators see it outside the worker log: what to do about it."""
        fixes = []
        if self.provider_only:
            fixes.append("set SHEPHERD_ASSIMILATE=true to register the machines the BMDB "
                         "lacks")
        if self.bmdb_only:
            fixes.append("machines the provider no longer lists need an operator: find out "
                         "why they are gone")
        return f"{self}; {'; '.join(fixes)}"


@dataclass(frozen=True)
class ProvisionerSettings:
    """Bounds of one reconcile run.

    ``chunk_size`` counts creation *attempts*, failed ones included, so a run where
    every reservation fails still makes at most ``chunk_size`` create calls.
    ``creation_rate`` is creations per second (0: as fast as the provider answers).
    """

    max_machines: int
    chunk_size: int
    creation_rate: float
    cooldown: float = 3600.0
    assimilate: bool = False

    def __post_init__(self) -> None:
        if self.max_machines < 0:
            raise ValueError(f"max_machines must be >= 0, got {self.max_machines}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if not (math.isfinite(self.creation_rate) and self.creation_rate >= 0):
            raise ValueError(f"creation_rate must be a finite number >= 0, "
                             f"got {self.creation_rate}")
        if not (math.isfinite(self.cooldown) and self.cooldown >= 0):
            raise ValueError(f"cooldown must be a finite number >= 0, got {self.cooldown}")

    @property
    def spacing(self) -> float:
        """Seconds between creation starts."""
        return 1.0 / self.creation_rate if self.creation_rate > 0 else 0.0


@dataclass(frozen=True)
class ReconcileResult:
    """What one run did (Flower shows it): ids and counts, no secrets."""

    provider: str
    busy: bool = False
    machines_before: int = 0
    machines_after: int = 0
    max_machines: int = 0
    created: tuple[str, ...] = ()
    failed: dict[str, str] = field(default_factory=dict)
    assimilated: int = 0
    #: Machines of interrupted creations, recognised by their intent and registered.
    recovered: int = 0
    skipped_cooling: int = 0

    def to_json(self) -> dict[str, Any]:
        if self.busy:
            return {"skipped": SKIPPED}
        return {"provider": self.provider, "busy": self.busy,
                "machines_before": self.machines_before,
                "machines_after": self.machines_after, "max_machines": self.max_machines,
                "created": list(self.created), "failed": dict(self.failed),
                "assimilated": self.assimilated, "recovered": self.recovered,
                "skipped_cooling": self.skipped_cooling}


def reconcile(session: bmdb.Session, provider: Provider, settings: ProvisionerSettings, *,
              wait_for_running: float = 0.0) -> ReconcileResult:
    """Check the fleets agree (or assimilate), then create up to a chunk of machines.

    A run that meets another one running skips (beat's: the next is seconds away), or
    first waits up to ``wait_for_running`` seconds for it to end (an operator's, who
    asked for a reconcile's answer, not for "already running").

    Raises ``FleetMismatch`` when they disagree, the provider's typed error when it
    cannot be listed, and ``SessionExpired`` when the session ends under us.
    """
    refuse_placeholder("provider name", provider.name)
    with bmdb.hold_singleton(session, RECONCILE_HOLD, wait=wait_for_running) as held:
        if not held:
            log.info("%s elsewhere; skipped", SKIPPED)
            return ReconcileResult(provider.name, busy=True, max_machines=settings.max_machines)
        return _reconcile_held(session, provider, settings)


def _reconcile_held(session: bmdb.Session, provider: Provider,
                    settings: ProvisionerSettings) -> ReconcileResult:
    # Every listing comes before the first write: an outage means no action at all.
    machines = list(provider.list_machines())
    room = max(0, settings.max_machines - len(machines))
    capacity = provider.list_capacity() if room else []
    known = session.transact(lambda tx: bmdb.provided_by_provider_id(tx, provider.name))
    recovered = register_interrupted(session, provider, machines, known)
    known = {**known, **recovered}
    try:
        assimilated = check_fleets(session, provider, machines, known, settings.assimilate)
    except FleetMismatch as mismatch:
        advice = mismatch.advice
        session.transact(lambda tx: bmdb.record_refusal(tx, provider.name, advice))
        raise
    session.transact(lambda tx: bmdb.clear_refusal(tx, provider.name))
    cooling = session.transact(lambda tx: bmdb.cooling(tx, provider.name))
    candidates = [c for c in capacity if c.reservation_id not in cooling]
    attempts = min(settings.chunk_size, room)
    if attempts < settings.chunk_size and candidates:
        log.info("%s: %d machines, maximum %d: creating at most %d", provider.name,
                 len(machines), settings.max_machines, attempts)
    created, failed = create_machines(session, provider, candidates[:attempts], settings)
    return ReconcileResult(
        provider.name,
        machines_before=len(machines),
        machines_after=len(machines) + len(created),
        max_machines=settings.max_machines,
        created=tuple(created),
        failed=failed,
        assimilated=assimilated,
        recovered=len(recovered),
        skipped_cooling=len(capacity) - len(candidates),
    )


def register_interrupted(session: bmdb.Session, provider: Provider,
                         machines: list[ProviderMachine], known: dict[str, Any]
                         ) -> dict[str, Any]:
    """Register the provider-only machines of our own pending creation intents;
    provider id -> machine id of each."""

    def body(tx: bmdb.Tx) -> dict[str, Any]:
        pending = bmdb.pending_intents(tx, provider.name)
        ours = [m for m in machines if m.provider_id not in known and m.witness in pending]
        registered = {}
        for machine in ours:
            registered[machine.provider_id] = register_provided(tx, provider.name, machine)
            bmdb.forget_intent(tx, provider.name, str(machine.witness))
        return registered

    registered = session.transact(body)
    if registered:
        log.warning("%s: registered %d machines whose creation was interrupted before it "
                    "was recorded: %s", provider.name, len(registered),
                    _shown(sorted(registered)))
    return registered


def check_fleets(session: bmdb.Session, provider: Provider, machines: list[ProviderMachine],
                 known: dict[str, Any], assimilate: bool) -> int:
    """Raise ``FleetMismatch`` unless both sides list the same ids; return how many
    provider-only machines were assimilated (registered) instead."""
    at_provider = {m.provider_id: m for m in machines}
    provider_only = sorted(set(at_provider) - set(known))
    bmdb_only = sorted(set(known) - set(at_provider))
    assimilated = 0
    if provider.authoritative:
        assimilate, bmdb_only = True, []
    if provider_only and assimilate:
        new = [at_provider[i] for i in provider_only]
        session.transact(lambda tx: _register_all(tx, provider.name, new))
        level = logging.INFO if provider.authoritative else logging.WARNING
        log.log(level, "%s: registered %d machines the BMDB lacked: %s", provider.name,
                len(new), _shown(provider_only))
        assimilated, provider_only = len(new), []
    if provider_only or bmdb_only:
        mismatch = FleetMismatch(provider.name, provider_only, bmdb_only)
        log.error("FLEET MISMATCH: %s", mismatch)
        raise mismatch
    return assimilated


def _register_all(tx: bmdb.Tx, provider: str, machines: list[ProviderMachine]) -> None:
    for machine in machines:
        register_provided(tx, provider, machine)


def create_machines(session: bmdb.Session, provider: Provider, capacity: list[Capacity],
                    settings: ProvisionerSettings) -> tuple[list[str], dict[str, str]]:
    """Create one machine per capacity, spaced in time, each registered on its own.

    A failed capacity is put in cooldown and the run goes on with the next, except
    after ``TransientExhausted``: the provider is struggling (down, or answering 5xx),
    which says nothing about that capacity. The run stops there and *nothing* cools
    down, not even the capacity tried: an hour's cooldown for a short outage would
    leave the fleet short long after the provider came back.
    """
    created: list[str] = []
    failed: dict[str, str] = {}
    pace = _Pacer(settings.spacing)
    for item in capacity:
        pace.wait()
        session.transact(functools.partial(
            bmdb.record_intent, provider=provider.name,
            capacity_id=item.reservation_id, witness=item.request_id))
        try:
            machine = provider.create_machine(item)  # no transaction open: see above
        except ProviderError as error:
            cause = _cause(error)
            failed[item.reservation_id] = cause
            if isinstance(error, TransientExhausted):  # it may have landed: keep the intent
                log.warning("%s: stopping this run's creations after %s", provider.name, cause)
                break
            session.transact(functools.partial(
                bmdb.forget_intent, provider=provider.name, witness=item.request_id))
            cool_down(session, provider.name, item.reservation_id, settings.cooldown, cause)
            continue
        session.transact(functools.partial(
            register_created, provider=provider.name, capacity=item, machine=machine))
        log.info("%s: created %s from reservation %s", provider.name, machine.provider_id,
                 item.reservation_id)
        created.append(machine.provider_id)
    return created, failed


def register_created(tx: bmdb.Tx, provider: str, capacity: Capacity,
                     machine: ProviderMachine) -> Any:
    """Register a machine just created from ``capacity`` and forget its intent, atomically.

    Why atomically: an intent forgotten while its machine is not registered would make
    the next reconcile take the machine for a stranger (``FleetMismatch``). Should this
    transaction never happen (the process dies, the session ends), the intent stays and
    the next reconcile registers the machine from it (``register_interrupted``).
    """
    machine_id = register_provided(tx, provider, machine)
    bmdb.forget_intent(tx, provider, capacity.request_id)
    return machine_id


def cool_down(session: bmdb.Session, provider: str, capacity_id: str, seconds: float,
              cause: str) -> None:
    """Record that ``capacity_id`` failed, so it sits out ``seconds`` (loudly, once)."""
    log.warning("%s: capacity %s failed to provision, cooling down %.0fs: %s", provider,
                capacity_id, seconds, cause)
    session.transact(
        lambda tx: bmdb.cool_down(tx, provider, capacity_id, seconds, cause)
    )


def _cause(error: Exception) -> str:
    cause = f"{type(error).__name__}: {error}"
    return cause if len(cause) <= MAX_CAUSE else cause[: MAX_CAUSE - 3] + "..."


def _shown(ids: list[str]) -> str:
    head = ", ".join(ids[:SHOWN_IDS])
    more = f", ... ({len(ids) - SHOWN_IDS} more)" if len(ids) > SHOWN_IDS else ""
    return f"[{head}{more}]"


class _Pacer:
    """Spaces calls ``spacing`` seconds apart (start to start); the first goes at once."""

    def __init__(self, spacing: float) -> None:
        self.spacing = spacing
        self._next = 0.0

    def wait(self) -> None:
        now = time.monotonic()
        if now < self._next:
            time.sleep(self._next - now)
            now = self._next
        self._next = now + self.spacing
