"""Recovery: bring back a machine whose agent went silent, by the gentlest step that works.

0. If the agent had been heard from and SSH still answers with the machine's pinned
   host key, only the agent is restarted (the initializer's takeover again): no
   reboot. Finishing records the new agent in place of the old one. If SSH answers
   with another key, nothing is reset (``no_reset_can_help``).
1.-3. Otherwise the verified reboot ladder (``ladder``) through the machine's power
   control (its BMC from the inventory, or its provider's reboot API).

After a verified reboot, finishing drops AgentStarted and AgentHeartbeat in one
transaction, which puts the machine back in the AgentStart backlog. A ladder climbed
to its end fails the work with the Recovery backoff; the ``quarantine_after``-th such
failure in a row quarantines the machine in the same transaction (``bmdb.holds``):
nothing automatic touches it again until an operator clears it.

Why rung 0 needs a heard-from agent: an agent that never reached the callback server
after its start will not reach it by being started again; a reboot at least changes
something.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import bmdb
from shepherd.power import PowerAction, PowerControl, PowerError
from shepherd.providers.base import NotFound, Provider, ProviderMachine
from shepherd.remote import HostKeyMismatch
from shepherd.workflows import ladder
from shepherd.workflows.bmc_check import check_the_bmc
from shepherd.workflows.common import (
    PERMANENT_BACKOFF,
    WorkflowFailure,
    WorkflowResult,
    provider_id_of,
    run_work,
)
from shepherd.workflows.initializer import (
    InitializerSettings,
    hold_on_mismatch,
    host_key_pin,
    record_agent,
    take_over_work,
)

log = logging.getLogger(__name__)

#: The power control of a machine, or None when nothing can reboot it.
PowerFor = Callable[[ProviderMachine], PowerControl | None]
QUARANTINE_ACTOR = "shepherd recovery"
#: The recorded actions that reset a machine (a boot-device change does not).
RESETS = frozenset(action.value for action in PowerAction)


@dataclass(frozen=True)
class RecovererSettings:
    """``quarantine_after``: ladders exhausted in a row before the machine is quarantined.
    ``agent_restart``: the initializer's settings for rung 0 (None: no rung 0)."""

    ladder: ladder.LadderSettings = field(default_factory=ladder.LadderSettings)
    quarantine_after: int = 3
    agent_restart: InitializerSettings | None = None
    permanent_backoff: bmdb.Backoff = PERMANENT_BACKOFF


def recover(work: bmdb.Work, provider: Provider, power_for: PowerFor,
            settings: RecovererSettings,
            clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], None] = time.sleep) -> WorkflowResult:
    """Restart the agent or climb the reboot ladder; finish, or fail with the cause."""

    def note(outcome: ladder.RungOutcome) -> None:
        log.info("recovery of %s: %s", work.machine_id, outcome.text())
        work.note(bmdb.Event.RUNG, outcome.text())

    def body() -> Callable[[bmdb.Tx], None]:
        machine = current_machine(work, provider, settings.permanent_backoff)
        restarted = restart_agent(work, machine, settings, note)
        if restarted is not None:
            return restarted
        power = power_for(machine)
        if power is None:
            raise WorkflowFailure(
                f"nothing can reboot this machine: its inventory entry has no bmc table and "
                f"provider {provider.name} has no reboot API", settings.permanent_backoff)
        refuse_a_bmc_not_answering(work, machine)
        endpoint = ladder.Endpoint(machine.address, machine.ssh_port)
        watch = ladder.Watch(power, endpoint, settings.ladder, clock, sleep)
        work.ensure_held()
        # A swapped inventory line would reset a healthy neighbour: check first.
        check_the_bmc(work, power, "bmc")
        refuse_a_second_reset(work, settings.ladder.rung_timeout)
        try:
            verified = ladder.climb(power, watch, note)
        except PowerError as error:
            raise WorkflowFailure(f"bmc: {type(error).__name__}: {error}") from error
        if verified is None:
            raise exhausted(work, power, settings.quarantine_after)
        if not watch.banner_back():
            log.warning("recovery of %s: SSH not back within %.0fs of %s; AgentStart will "
                        "retry", work.machine_id, settings.ladder.boot_wait, verified.name)
        return lambda tx: forget_agent(tx, work.machine_id)

    return run_work(work, body)


def current_machine(work: bmdb.Work, provider: Provider,
                    permanent: bmdb.Backoff) -> ProviderMachine:
    provider_id = provider_id_of(work, provider, permanent)
    try:
        return provider.get_machine(provider_id)
    except NotFound as error:
        raise WorkflowFailure(f"provider {provider.name}: device {provider_id} not found: "
                              f"{error}", permanent) from error


def restart_agent(work: bmdb.Work, machine: ProviderMachine, settings: RecovererSettings,
                  note: ladder.Note) -> Callable[[bmdb.Tx], None] | None:
    """Rung 0: a new agent over SSH, when allowed (see the module docstring); the tag
    changes to finish with, or None to climb the ladder."""
    init = settings.agent_restart
    if init is None or not machine.address:
        return None
    pin = host_key_pin(work, machine)
    heard = work.session.transact(
        lambda tx: bmdb.machine_tag(tx, "AgentHeartbeat", work.machine_id))
    if pin is None or heard is None:
        return None
    started = time.monotonic()
    work.ensure_held()
    try:
        taken = take_over_work(work, machine, init, pin)
    except WorkflowFailure as failure:
        note(ladder.RungOutcome(0, "agent restart", False, failure.cause,
                                time.monotonic() - started))
        if isinstance(failure.__cause__, HostKeyMismatch):
            raise hold_on_mismatch(no_reset_can_help(failure), failure.__cause__,
                                   work) from failure
        return None
    note(ladder.RungOutcome(0, "agent restart", True, "a new agent answered over SSH",
                            time.monotonic() - started))

    def replace_agent(tx: bmdb.Tx) -> None:
        forget_agent(tx, work.machine_id)
        record_agent(tx, work.machine_id, taken)

    return replace_agent


def refuse_a_bmc_not_answering(work: bmdb.Work, machine: ProviderMachine) -> None:
    """Fail before the ladder when the power and health sync found this machine's BMC
    not answering (unreachable, refusing its credentials, or failing) at its last read:
    the agent restart (rung 0) was all Recovery could do there. Climbing would only
    learn the same thing mid-ladder, after minutes of timeouts, with the BMC's lock
    held. The sync's next answered read clears the mark (``shepherd.workflows.bmc_sync``),
    and the next attempt climbs."""
    if machine.bmc is None:
        return  # a provider's reboot API: not the sync's to read
    synced = work.session.db.read(lambda tx: bmdb.bmc_sync_of(tx, work.machine_id))
    if synced is None or synced.answering:
        return
    since = iso(synced.status_since) if synced.status_since else "its last read"
    raise WorkflowFailure(
        f"bmc: the power and health sync found {synced.via} {synced.status} since {since}"
        f" ({synced.problem}); only the agent restart could be tried, and no reset is "
        f"tried until the BMC answers the sync again")


def refuse_a_second_reset(work: bmdb.Work, rung_timeout: float) -> None:
    """Fail, backing off until it has passed, while a power action asked less than one
    rung's timeout ago may be under way: an earlier attempt's (its worker was killed
    right after it sent a reset, so its ladder never said how it went) or an
    operator's. A second reset now would cut short the boot the first one started.
    The intent was recorded before that call (``shepherd.power.recorded``), so it is
    seen even when nothing else was."""
    def read(tx: bmdb.Tx) -> tuple[bmdb.PowerObservation | None, dt.datetime]:
        return bmdb.power_of(tx, work.machine_id), tx.now

    seen, now = work.session.db.read(read)
    if (seen is None or seen.acted_at is None or seen.action not in RESETS
            or not seen.may_be_under_way(now - dt.timedelta(seconds=rung_timeout))):
        return
    until = seen.acted_at + dt.timedelta(seconds=rung_timeout)
    wait = max(1.0, (until - now).total_seconds())
    outcome = seen.outcome or "acknowledged"
    raise WorkflowFailure(
        f"{seen.action} was asked of {seen.via} at {iso(seen.acted_at)} ({outcome}); no "
        f"second reset before {iso(until)}, one rung's timeout later",
        bmdb.Backoff(initial=wait, maximum=wait, exponent=1.0))


def iso(at: dt.datetime) -> str:
    return at.isoformat(timespec="seconds")


def no_reset_can_help(failure: WorkflowFailure) -> WorkflowFailure:
    """Rung 0 met another host key than the pinned one: the machine answers SSH, so
    it is up, and no reset changes the key it presents (a reinstall behind Shepherd's
    back, or another machine at this address). Resetting it would power-cycle a
    running machine for nothing, so the ladder stops here, before any BMC call, and
    the machine is held for an operator to look (``hold_on_mismatch``)."""
    return WorkflowFailure(
        f"{failure.cause}; no reset tried: the machine answers SSH, and a reset cannot "
        f"change the key it presents (reinstalled, or another machine at this address?)",
        failure.backoff)


def exhausted(work: bmdb.Work, power: PowerControl, limit: int) -> WorkflowFailure:
    """The failure of a ladder climbed to its end; quarantines on the ``limit``-th."""
    cause = (f"{bmdb.LADDER_EXHAUSTED}: no rung was verified through "
             f"{power.description} (see the Rung entries in history)")

    def quarantine(tx: bmdb.Tx) -> None:
        if bmdb.quarantine_if_due(tx, work.machine_id, limit, QUARANTINE_ACTOR):
            log.error("QUARANTINED %s: the reboot ladder was exhausted %d times in a row",
                      work.machine_id, limit)

    return WorkflowFailure(cause, then=quarantine)


def forget_agent(tx: bmdb.Tx, machine_id: uuid.UUID) -> None:
    """Drop AgentStarted and AgentHeartbeat: the old agent and its key are gone."""
    bmdb.delete_heartbeat(tx, machine_id)
    bmdb.delete_agent_started(tx, machine_id)
