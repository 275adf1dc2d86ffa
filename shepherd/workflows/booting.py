"""Booting a machine into a chosen system through its BMC, and taking that system over.

The installation workflow (``installation``) uses it twice: to boot the *rescue* system
(network or virtual media) when no agent runs on the machine or the disk to write is the
one the running system sits on, and to boot the *installed* system from its disk once the
image is written, verified and given its identity. Both go the same way, each step
recorded (``bmdb.advance_installation``) with its own deadline:

1. **boot_device**: check that the BMC manages this machine (``shepherd.power.mismatch``),
   then set the next boot through the BMC and read it back
   (``shepherd.power.set_boot_and_verify``): a BMC that acknowledged but did not take it
   stops the installation here, with what it read back.
2. **rebooting**: power off, observed Off, power on, observed On (the ladder's rung 3,
   ``ladder.cold_boot``): a cold boot, so the firmware reads the new boot device. Where
   the BMC cannot power off, a force restart observed the ladder's way.
3. **taking_over**: wait for the SSH banner (``ssh_deadline`` from power on), then the
   initializer's takeover with the pin of the system that should answer. A key other than
   the pinned one is refused before anything is uploaded, and the cause names both keys
   and which system the seen one belongs to when it is known (the rescue system's key:
   "the machine did not boot its disk").
4. **first_heartbeat**: the new agent's first heartbeat must arrive within
   ``heartbeat_deadline``; for the installed system it must carry the marker of this very
   generation (``installation.json``, written by the agent beside the host key), which is
   what proves the system that answered is the one this installation wrote.

Invariants: the old agent is forgotten and the new one recorded in one transaction,
after the takeover proved the new one (``initializer.record_agent``), so heartbeats of the
system that went down are never mistaken for the new one's; every wait checks the claim
(``Work.ensure_held``) so a lost claim stops the machine's boot at once.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import bmdb
from shepherd.inventory.host_keys import key_line_fingerprint
from shepherd.power import BootDevice, PowerControl, PowerError, set_boot_and_verify
from shepherd.providers.base import ProviderMachine
from shepherd.remote import HostKeyMismatch
from shepherd.workflows import ladder
from shepherd.workflows.bmc_check import check_the_bmc
from shepherd.workflows.common import WorkflowFailure
from shepherd.workflows.initializer import (
    HostKeyPin,
    InitializerSettings,
    Takeover,
    record_agent,
    take_over_work,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BootSettings:
    """How the installation boots machines and takes them over.

    ``takeover``: the initializer's settings (SSH key, callback URL, agent arguments).
    ``ladder``: the power verbs' timing (``rung_timeout`` bounds the reboot step).
    ``ssh_deadline``: seconds from power on to the SSH banner. ``heartbeat_deadline``:
    seconds from the takeover to the new agent's first heartbeat (with its marker).
    ``rescue_device``: what boots the rescue system (network, or cd for virtual media).
    """

    takeover: InitializerSettings
    ladder: ladder.LadderSettings = field(default_factory=ladder.LadderSettings)
    ssh_deadline: float = 300.0
    heartbeat_deadline: float = 120.0
    rescue_device: BootDevice = BootDevice.NETWORK
    #: Seconds between looks for the SSH banner and the first heartbeat (a refused
    #: connection and a BMDB read each: cheap, and each look shortens the boot's wait).
    poll_interval: float = 0.2


@dataclass(frozen=True)
class Target:
    """What one boot must bring up: the device, the pin of the system that should answer
    (and the pin of the one that must not, for a cause that names it), and the marker
    its first heartbeat must carry (None: any first heartbeat will do)."""

    name: str
    device: BootDevice
    persistent: bool
    pin: HostKeyPin | None
    other: HostKeyPin | None = None
    marker: dict[str, Any] | None = None


Step = Callable[[str], None]


def boot_into(work: bmdb.Work, machine: ProviderMachine, power: PowerControl,
              target: Target, settings: BootSettings, step: Step) -> None:
    """Boot ``machine`` into ``target`` and take it over (the module's four steps);
    ``WorkflowFailure`` with what was last observed when a step misses its deadline."""
    step("boot_device")
    check_the_bmc(work, power, "boot_device")
    set_boot(power, target)
    step("rebooting")
    powered_on = reboot(work, machine, power, settings)
    step("taking_over")
    taken = take_over_booted(work, machine, target, settings, powered_on)
    step("first_heartbeat")
    await_first_heartbeat(work, target, settings)
    log.info("%s booted into %s (agent key %s…)", work.machine_id, target.name,
             taken.agent_key.hex()[:12])


def set_boot(power: PowerControl, target: Target) -> None:
    try:
        read_back = set_boot_and_verify(power, target.device, persistent=target.persistent)
    except PowerError as error:
        raise WorkflowFailure(f"boot_device: {error}") from error
    log.info("%s: next boot %s", power.description, read_back.text)


def reboot(work: bmdb.Work, machine: ProviderMachine, power: PowerControl,
           settings: BootSettings) -> float:
    """A cold boot, observed; returns when power came on (``time.monotonic``)."""
    watch = ladder.Watch(power, ladder.Endpoint(machine.address, machine.ssh_port),
                         settings.ladder)
    work.ensure_held()
    try:
        outcome = ladder.cold_boot(power, watch)
    except PowerError as error:
        raise WorkflowFailure(f"rebooting: {type(error).__name__}: {error}") from error
    work.note(bmdb.Event.RUNG, outcome.text())
    if not outcome.verified:
        raise WorkflowFailure(f"rebooting: {outcome.name} not verified: {outcome.detail}")
    return time.monotonic()


def take_over_booted(work: bmdb.Work, machine: ProviderMachine, target: Target,
                     settings: BootSettings, powered_on: float) -> Takeover:
    """The banner within the deadline, then a takeover with ``target.pin``; the new
    agent replaces the old one in the BMDB."""
    endpoint = ladder.Endpoint(machine.address, machine.ssh_port)
    while not ladder.ssh_banner(endpoint, settings.ladder.banner_timeout):
        waited = time.monotonic() - powered_on
        if waited > settings.ssh_deadline:
            raise WorkflowFailure(f"taking_over: no SSH banner within "
                                  f"{settings.ssh_deadline:g} s of power on ({target.name})")
        work.ensure_held()
        time.sleep(settings.poll_interval)
    try:
        taken = take_over_work(work, machine, settings.takeover, target.pin)
    except WorkflowFailure as failure:
        raise WorkflowFailure(f"taking_over: {mismatch_cause(failure, target)}") from failure
    work.session.transact(lambda tx: replace_agent(tx, work.machine_id, taken))
    return taken


def mismatch_cause(failure: WorkflowFailure, target: Target) -> str:
    """The takeover's cause, saying whose key answered when it is one we know."""
    mismatch = failure.__cause__
    if not isinstance(mismatch, HostKeyMismatch):
        return failure.cause
    seen, expected = mismatch.seen, mismatch.expected
    whose = ""
    if target.other is not None and same_key(seen, target.other.key):
        whose = (f"; that is the {target.other.source}'s key, so the machine did not boot "
                 f"{target.name}")
    return (f"SSH answered with host key {key_line_fingerprint(seen)}, not "
            f"{target.name}'s {key_line_fingerprint(expected)}{whose}")


def same_key(one: str, other: str) -> bool:
    return one.split()[:2] == other.split()[:2]


def replace_agent(tx: bmdb.Tx, machine_id: uuid.UUID, taken: Takeover) -> None:
    """The old system's agent is gone with it: its tags go, the new one's are written."""
    bmdb.delete_heartbeat(tx, machine_id)
    bmdb.delete_agent_started(tx, machine_id)
    record_agent(tx, machine_id, taken)


def await_first_heartbeat(work: bmdb.Work, target: Target, settings: BootSettings) -> None:
    """The new agent's first heartbeat, with ``target.marker`` in its hardware report
    when one is asked for."""
    started = time.monotonic()
    last = "no heartbeat yet"
    while True:
        # The first heartbeat of an agent carries its hardware report, written in the
        # same transaction: once the new agent was heard, the report is its own.
        heard, report = work.session.db.read(lambda tx: (
            bmdb.machine_tag(tx, "AgentHeartbeat", work.machine_id),
            bmdb.machine_tag(tx, "HardwareReport", work.machine_id)))
        if heard is not None:
            marker = ((report or {}).get("report") or {}).get("installation")
            if target.marker is None or marks(marker, target.marker):
                return
            last = f"a heartbeat whose system reports installation {describe_marker(marker)}"
        if time.monotonic() - started > settings.heartbeat_deadline:
            raise WorkflowFailure(f"first_heartbeat: within {settings.heartbeat_deadline:g} s "
                                  f"of the takeover of {target.name}, {last}")
        work.ensure_held()
        time.sleep(settings.poll_interval)


def marks(marker: Any, expected: dict[str, Any]) -> bool:
    return isinstance(marker, dict) and all(marker.get(k) == v for k, v in expected.items())


def describe_marker(marker: Any) -> str:
    if not isinstance(marker, dict):
        return "none (no /etc/shepherd/installation.json)"
    return f"generation {marker.get('generation')} of image {marker.get('image')}"
