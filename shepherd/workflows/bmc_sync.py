"""The power and health sync: every BMC of the inventory read on a schedule, within a
budget, so operators and Recovery learn that a BMC is broken before they need it.

Why: without it Shepherd talks to a BMC only when Recovery needs it, the worst moment
to find out its password changed. Peers show what polling without a budget does
(BMC web interfaces crashing under polls, IPMI BMCs freezing after bursts), so every
read here keeps four rules, each enforced where it is named:

* **One call per BMC at a time**, fleet-wide: every read holds the BMC's singleton
  (``shepherd.power.ExclusivePower``), as Recovery's calls do. Within a run, the
  machines behind one BMC are read one after another by one thread (``_by_bmc``).
* **A minimum interval per machine**: the schedule is rows in the BMDB, and a read is
  claimed by moving its row an interval ahead (``bmdb.claim_bmc_reads``), so however
  many workers run the sync, a machine's BMC is read at most once per
  ``SHEPHERD_BMC_SYNC_INTERVAL``.
* **A fleet-wide cap, Recovery first**: every read takes one of the
  ``SHEPHERD_BMC_CALLS_MAX`` call slots, but only from those after the first
  ``SHEPHERD_BMC_CALLS_RESERVED``, which stay free for Recovery, ``shepherd power`` and
  installations; a BMC or slot not free within ``LOCK_WAIT`` is read again soon, not
  waited for.
* **Jitter and pace**: a new machine's first read falls anywhere in the first
  interval, and each next read up to ``JITTER`` of an interval late, so a fleet never
  polls in step; and a run reads at most twice the pace the interval needs
  (``reads_per_run``), so even a backlog of every machine drains in half an interval
  without a burst of BMDB commits beside the heartbeats.

What a read finds is recorded (``bmdb.record_bmc_reading``, and the power through
``bmdb.record_power_observed``): the health, the time the BMC took, and its status,
``answering``, ``slow``, ``unreachable``, ``auth-refused`` or ``failing``; the last
three tell Recovery it can only restart the agent there (``recoverer``). A read also
compares the BMC's system with the machine's DMI, so a swapped pair of inventory lines
is held (``shepherd.power.mismatch``) before anyone acts through either, and flags a
BMC that says Off while the agent heartbeats: that one is wired to another machine.

Each beat tick starts one run (``sync``), which starts reads for ``tick`` seconds and
returns once they ended.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import math
import random
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import bmdb
from shepherd.bmc import BmcSpec
from shepherd.power import (
    BmcAuthFailed,
    BmcBusy,
    BmcControl,
    BmcSurvey,
    BmcUnreachable,
    ExclusivePower,
    PowerError,
    PowerState,
)
from shepherd.power.mismatch import BmcMismatch, hold_if_mismatched
from shepherd.providers.base import API_PROVIDERS, Provider, ProviderMachine

log = logging.getLogger(__name__)

#: Each next read comes up to this share of an interval late, at random.
JITTER = 0.1
#: Seconds a read waits for its BMC (another call on it) or a call slot, then gives way.
LOCK_WAIT = 2.0
#: Seconds until a read that gave way is due again.
RETRY_BUSY = 5.0
#: Reads claimed per transaction.
BATCH = 64
#: How much faster than the interval needs a run may read (``reads_per_run``).
PACE = 2.0
#: Who the sync's holds and history name.
ACTOR = "bmc-sync"


@dataclass(frozen=True)
class SyncSettings:
    """``interval``: seconds between two reads of one machine's BMC, at least;
    ``tick``: how long one run starts reads; ``calls_cap`` and ``reserved``: the
    fleet-wide call slots and how many of them the sync leaves to others; ``slow``:
    seconds after which an answer counts as slow; ``heartbeat_timeout``: how recent a
    heartbeat contradicts a BMC that says Off."""

    interval: float = 300.0
    tick: float = 10.0
    calls_cap: int = 16
    reserved: int = 4
    slow: float = 5.0
    heartbeat_timeout: float = 600.0

    @property
    def threads(self) -> int:
        """Reads in flight from one run: the slots open to the sync."""
        return self.calls_cap - self.reserved


@dataclass
class SyncResult:
    enrolled: int = 0
    answered: int = 0
    failed: int = 0
    busy: int = 0
    held: int = 0
    dropped: int = 0
    statuses: dict[str, int] = field(default_factory=dict)

    def add(self, outcome: str) -> None:
        self.statuses[outcome] = self.statuses.get(outcome, 0) + 1

    def include(self, other: SyncResult) -> None:
        """Adds another run's counts: what several runs did together (a pass)."""
        for name in ("enrolled", "answered", "failed", "busy", "held", "dropped"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for status, count in other.statuses.items():
            self.statuses[status] = self.statuses.get(status, 0) + count

    @property
    def reads(self) -> int:
        """Machines read (answered, failed or held): not those postponed as busy."""
        return self.answered + self.failed + self.held

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def open_session(db: bmdb.BMDB, interval: float) -> bmdb.Session:
    """The sync's own BMDB session, not the worker's: its commits are not flushed to
    disk before they return (``durable=False``). Everything it writes is an observation
    read again within an interval, or a BMC lock that a crashed BMDB frees anyway; so a
    crash may lose the last of it, and heartbeats never wait behind its disk flushes
    (the bench measured their p99 up 50 % beside a backlog's reads without this)."""
    return db.start_session("bmc-sync", interval=interval, durable=False)


#: Builds the driver of a BMC (``shepherd.power.connect`` with the settings' timeouts).
Connect = Callable[[BmcSpec], BmcControl]


def sync(session: bmdb.Session, provider: Provider, settings: SyncSettings,
         connect: Connect, clock: Callable[[], float] = time.monotonic) -> SyncResult:
    """One run: enroll the inventory's new BMCs, then read what is due for ``tick``
    seconds, ``settings.threads`` at a time."""
    machines = machines_with_a_bmc(session, provider)
    result = SyncResult(enrolled=enroll(session, machines, settings.interval))
    deadline = clock() + settings.tick
    budget = reads_per_run(len(machines), settings)
    with ThreadPoolExecutor(settings.threads, thread_name_prefix="bmc-sync") as pool:
        while clock() < deadline and budget > 0:
            due = session.transact(functools.partial(claim, interval=settings.interval,
                                                     most=budget))
            budget -= len(due)
            if not due:
                break
            groups = _by_bmc(due, machines, session, result)
            for outcomes in pool.map(lambda group: _read_group(
                    session, group, settings, connect), groups):
                for outcome in outcomes:
                    _count(result, outcome)
    return result


def machines_with_a_bmc(session: bmdb.Session, provider: Provider
                        ) -> dict[uuid.UUID, ProviderMachine]:
    """The provider's machines that the BMDB has and whose inventory entry names a BMC.
    A provider with an API has none (its reboots are its API's): it is not listed, so
    the sync never costs it a call."""
    if provider.name in API_PROVIDERS:
        return {}
    listed = {m.provider_id: m for m in provider.list_machines() if m.bmc is not None}
    if not listed:
        return {}
    known = session.db.read(lambda tx: bmdb.provided_by_provider_id(tx, provider.name))
    return {known[pid]: machine for pid, machine in listed.items() if pid in known}


def enroll(session: bmdb.Session, machines: Iterable[uuid.UUID], interval: float) -> int:
    """Book the machines not booked yet, each first due at a random moment of the first
    interval (a new rack's BMCs are not all read at once)."""
    offsets = {machine_id: random.uniform(0, interval) for machine_id in machines}
    if not offsets:
        return 0
    return session.transact(lambda tx: bmdb.enroll_bmcs(tx, offsets))


def reads_per_run(machines: int, settings: SyncSettings) -> int:
    """The most reads one run starts: twice the pace the interval needs (every machine
    once per interval, a run every tick), and at least one per thread. So a backlog
    (a new rack, a sync that was off) drains within half an interval, at a pace that
    leaves the BMDB's commits to the heartbeats, instead of in one burst."""
    return max(settings.threads, math.ceil(PACE * machines * settings.tick
                                           / settings.interval))


def claim(tx: bmdb.Tx, interval: float, most: int) -> list[uuid.UUID]:
    return bmdb.claim_bmc_reads(tx, min(BATCH, most), lambda: next_read_in(interval))


def next_read_in(interval: float) -> float:
    """Seconds until a machine's next read: the interval, and up to ``JITTER`` more."""
    return interval * (1 + random.uniform(0, JITTER))


def _by_bmc(due: list[uuid.UUID], machines: dict[uuid.UUID, ProviderMachine],
            session: bmdb.Session, result: SyncResult
            ) -> list[list[tuple[uuid.UUID, ProviderMachine]]]:
    """The due machines grouped by BMC (``BmcSpec.lock_name``), so one thread reads one
    BMC's machines in turn; a booked machine that lost its BMC leaves the book."""
    groups: dict[str, list[tuple[uuid.UUID, ProviderMachine]]] = {}
    gone = [machine_id for machine_id in due if machine_id not in machines]
    for machine_id in due:
        machine = machines.get(machine_id)
        if machine is not None and machine.bmc is not None:
            groups.setdefault(machine.bmc.lock_name, []).append((machine_id, machine))
    if gone:
        def drop(tx: bmdb.Tx) -> None:
            for machine_id in gone:
                bmdb.drop_bmc_sync(tx, machine_id)

        session.transact(drop)
        result.dropped += len(gone)
    return list(groups.values())


def _read_group(session: bmdb.Session, group: list[tuple[uuid.UUID, ProviderMachine]],
                settings: SyncSettings, connect: Connect) -> list[str]:
    """One BMC's due machines, in turn. Once the BMC did not answer, the rest are marked
    unreachable without a call: each would wait out the same timeouts (up to
    attempts x timeout apiece) with a thread of the run, and say nothing new."""
    outcomes: list[str] = []
    for machine_id, machine in group:
        if outcomes and outcomes[-1] == bmdb.BMC_UNREACHABLE:
            via = machine.bmc.description if machine.bmc else "its BMC"
            outcomes.append(_record_failure(session, machine_id, via, BmcUnreachable(
                f"{via}: not asked: it did not answer a read of another of its machines "
                f"a moment before")))
            continue
        outcomes.append(read_one(session, machine_id, machine, settings, connect))
    return outcomes


def _count(result: SyncResult, outcome: str) -> None:
    result.add(outcome)
    if outcome == "busy":
        result.busy += 1
    elif outcome == "held":
        result.held += 1
    elif outcome in bmdb.BMC_NOT_ANSWERING:
        result.failed += 1
    else:
        result.answered += 1


def read_one(session: bmdb.Session, machine_id: uuid.UUID, machine: ProviderMachine,
             settings: SyncSettings, connect: Connect) -> str:
    """Read one machine's BMC and record what it found; the outcome, a status or
    "busy" or "held". Never raises for the BMC's sake: a BMC's failure is its status."""
    assert machine.bmc is not None
    held = session.db.read(lambda tx: bmdb.holds_of(tx, machine_id, bmdb.BMC_MISMATCH_HOLD))
    if held:
        return "held"  # its BMC manages another system: nothing it says is this machine's
    driver = connect(machine.bmc)
    power = ExclusivePower(driver, session, machine.bmc.lock_name, wait=LOCK_WAIT,
                           calls_cap=settings.calls_cap, reserved=settings.reserved)
    try:
        survey, seconds = _timed_survey(power, driver)
    except BmcBusy:
        session.transact(lambda tx: bmdb.postpone_bmc_read(tx, machine_id, RETRY_BUSY))
        return "busy"
    except PowerError as error:
        return _record_failure(session, machine_id, driver.description, error)
    try:
        hold_if_mismatched(session, machine_id, survey.identity, driver.description, ACTOR)
    except BmcMismatch as error:
        log.error("%s: %s", machine_id, error)
        return "held"
    return _record_answer(session, machine_id, driver.description, survey, seconds, settings)


def _timed_survey(power: ExclusivePower, driver: BmcControl) -> tuple[BmcSurvey, float]:
    """The survey, and the seconds the BMC took: the driver's measure where it has one
    (an IPMI helper's start is the worker's time, not the BMC's), else the call's; never
    the wait for the BMC's lock."""
    with power.held():
        started = time.monotonic()
        survey = driver.survey()
        took = time.monotonic() - started
    return survey, took if survey.seconds is None else survey.seconds


def _record_failure(session: bmdb.Session, machine_id: uuid.UUID, via: str,
                    error: PowerError) -> str:
    status = (bmdb.BMC_AUTH_REFUSED if isinstance(error, BmcAuthFailed)
              else bmdb.BMC_UNREACHABLE if isinstance(error, BmcUnreachable)
              else bmdb.BMC_FAILING)
    reading = bmdb.BmcReading(status, 0.0, via, problem=f"{type(error).__name__}: {error}")
    before = session.transact(lambda tx: bmdb.record_bmc_reading(tx, machine_id, reading))
    if before is not None and before.status != status:
        log.warning("%s: BMC %s: %s", machine_id, status, reading.problem)
    return status


def _record_answer(session: bmdb.Session, machine_id: uuid.UUID, via: str,
                   survey: BmcSurvey, seconds: float, settings: SyncSettings) -> str:
    slow = seconds > settings.slow
    status = bmdb.BMC_SLOW if slow else bmdb.BMC_ANSWERING

    def write(tx: bmdb.Tx) -> bmdb.BmcSync | None:
        contradiction = _contradiction(tx, machine_id, survey.power,
                                       settings.heartbeat_timeout)
        bmdb.record_power_observed(tx, machine_id, survey.power.value, via)
        return bmdb.record_bmc_reading(tx, machine_id, bmdb.BmcReading(
            status, seconds, via, health=survey.health and survey.health.value,
            health_detail=survey.health_detail, contradiction=contradiction,
            problem=(f"answered in {seconds:.1f}s (slow above {settings.slow:g}s)"
                     if slow else None)))

    before = session.transact(write)
    if before is not None and before.status != status:
        log.info("%s: BMC %s again (was %s)", machine_id, status, before.status)
    return status


def _contradiction(tx: bmdb.Tx, machine_id: uuid.UUID, power: PowerState,
                   heartbeat_timeout: float) -> str | None:
    """The BMC says Off, yet the agent heartbeated within a heartbeat timeout: it is
    not this machine's BMC (or not this BMC's machine). Said in words, or None."""
    if power is not PowerState.OFF:
        return None
    glance = bmdb.glances(tx, [machine_id]).get(machine_id)
    heard = glance.last_heartbeat_at if glance else None
    if heard is None or tx.now - heard > dt.timedelta(seconds=heartbeat_timeout):
        return None
    return (f"the BMC says Off, but the agent heartbeated at "
            f"{heard.isoformat(timespec='seconds')}: is this BMC wired to this machine?")
