"""An operator's power command on one machine: read its power, or turn it on, off, or
off and on again, or set the device it boots next, through the same drivers Recovery
uses.

Why a claim: ``on``, ``off`` and ``cycle`` change the machine under the workflows'
feet, so they run as work of ``Process.POWER``, in the exclusion group of AgentStart
and Recovery: refused with the BMDB's reason (``MachineBusy``) while either holds the
machine, and neither can claim it while the command runs. A machine in maintenance
can be claimed: powering it is what maintenance is for. ``status`` only reads, so it
claims nothing (the BMC's fleet-wide lock still applies: ``Runtime.power_for``).

Verified like the reboot ladder's rungs: by polling the power state until it is the
one wanted (``ladder.Watch``), never by the BMC's acknowledgement. The outcome is a
``Power`` history row, then ``Finished``; a failure cancels the work with its cause
(history says ``Canceled``, no backoff: an operator is there to read it).

Every change first checks that the BMC manages this machine (``shepherd.power.mismatch``):
a machine held on a BMC mismatch, or found to be one now (then held), is refused with
both identities, the claim cancelled.

``bootdev`` is a change too, under the same claim and with the same history, but it is
verified by reading the boot override back (``set_boot_and_verify``): a BMC that
acknowledged and kept another device fails the command with what it read.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import bmdb
from shepherd.operations.reads import provided_at
from shepherd.power import (
    BootDevice,
    PowerAction,
    PowerControl,
    PowerError,
    PowerState,
    set_boot_and_verify,
)
from shepherd.power.mismatch import refuse_if_mismatched
from shepherd.providers.base import NotFound, Provider, ProviderError, ProviderMachine
from shepherd.workflows.ladder import Endpoint, LadderSettings, Watch

COMMANDS = ("status", "on", "off", "cycle", "bootdev")
#: What ``bootdev`` takes.
BOOT_DEVICES = tuple(device.value for device in BootDevice)
#: The history event of a power command's outcome (at most 16 characters).
POWER_EVENT = "Power"
#: The history event of a verified boot-device change.
BOOT_DEVICE_EVENT = "BootDevice"
#: What each changing command does: (action, the state that verifies it), in order.
STEPS: dict[str, tuple[tuple[PowerAction, PowerState], ...]] = {
    "on": ((PowerAction.POWER_ON, PowerState.ON),),
    "off": ((PowerAction.POWER_OFF, PowerState.OFF),),
    "cycle": ((PowerAction.POWER_OFF, PowerState.OFF), (PowerAction.POWER_ON, PowerState.ON)),
}

PowerFor = Callable[[ProviderMachine], PowerControl | None]


class PowerRefused(Exception):
    """The command cannot be done (no provider lists the machine, nothing controls its
    power, the BMC failed or did not do it in time); the message says which."""


@dataclass(frozen=True)
class PowerTarget:
    machine_id: uuid.UUID
    provider: str
    provider_id: str
    machine: ProviderMachine
    power: PowerControl

    @property
    def bmc(self) -> str:
        return self.power.description


@dataclass(frozen=True)
class PowerStatus:
    machine: uuid.UUID
    provider: str
    provider_id: str
    bmc: str
    power: str


@dataclass(frozen=True)
class PowerResult:
    machine: uuid.UUID
    command: str
    bmc: str
    #: The power state seen last ("On", "Off").
    power: str
    #: What was observed, step by step ("off: power On -> Off; on: power Off -> On").
    detail: str
    seconds: float
    work: uuid.UUID
    #: Holds of the machine (``maintenance``, ``quarantine``) at the claim.
    holds: list[bmdb.HoldKind]


@dataclass(frozen=True)
class BootDeviceResult:
    machine: uuid.UUID
    bmc: str
    #: What was asked: the device, and whether for every boot.
    device: str
    persistent: bool
    #: What the BMC reported afterwards (``BootOverride``): it has ``device`` (checked),
    #: its persistence may differ (``shepherd.power.bootdev``).
    read_device: str
    read_persistent: bool | None
    read_back: str
    raw: str
    seconds: float
    work: uuid.UUID
    holds: list[bmdb.HoldKind]


def locate(session: bmdb.Session, provider_of: Callable[[], Provider], power_for: PowerFor,
           machine_id: uuid.UUID) -> PowerTarget:
    """The machine as its provider lists it now, and its power control; ``PowerRefused``
    when there is none (``UnknownMachine`` for no such machine). ``provider_of`` is
    called once the BMDB knows the machine: building a provider may cost API calls."""
    provided = provided_at(session, machine_id)
    if provided is None:
        raise PowerRefused(f"machine {machine_id} has no Provided tag: no provider lists it, "
                           "so nothing says where its BMC is")
    name, provider_id = provided
    provider = provider_of()
    if name != provider.name:
        raise PowerRefused(f"machine {machine_id} is provided by {name}, but this shepherd's "
                           f"provider is {provider.name} (SHEPHERD_PROVIDER)")
    try:
        machine = provider.get_machine(provider_id)
    except NotFound:
        raise PowerRefused(f"machine {machine_id}: {name} no longer lists {provider_id}, so "
                           "nothing says where its BMC is") from None
    except ProviderError as error:
        raise PowerRefused(f"machine {machine_id}: provider {name}: {error}") from None
    try:
        power = power_for(machine)
    except PowerError as error:
        raise PowerRefused(f"machine {machine_id} ({name} {provider_id}): "
                           f"{type(error).__name__}: {error}") from None
    if power is None:
        raise PowerRefused(f"machine {machine_id} ({name} {provider_id}): nothing controls "
                           f"its power: its inventory entry has no bmc table and provider "
                           f"{name} has no reboot API")
    return PowerTarget(machine_id, name, provider_id, machine, power)


def read_status(target: PowerTarget) -> PowerStatus:
    """The machine's power as its BMC reports it now."""
    try:
        state = target.power.power_state()
    except PowerError as error:
        raise PowerRefused(f"machine {target.machine_id}: {type(error).__name__}: "
                           f"{error}") from None
    return PowerStatus(target.machine_id, target.provider, target.provider_id, target.bmc,
                       state.value)


def change(session: bmdb.Session, target: PowerTarget, command: str,
           settings: LadderSettings, actor: str,
           clock: Callable[[], float] = time.monotonic,
           sleep: Callable[[float], None] = time.sleep) -> PowerResult:
    """Claim the machine for ``Process.POWER`` (``NotClaimable`` when busy), do
    ``command``'s steps, each verified within ``settings.rung_timeout``, then finish;
    on any failure cancel the claim with the cause and raise ``PowerRefused``."""
    steps = STEPS[command]
    work = session.claim_machine(bmdb.Process.POWER, target.machine_id)
    started = clock()
    try:
        holds = session.transact(lambda tx: [h.kind for h in bmdb.holds_of(
            tx, target.machine_id)])
        refuse_if_mismatched(session, target.machine_id, target.power, f"power by {actor}")
        power, detail = _run(work, target, steps, settings, clock, sleep)
    except BaseException as error:  # Ctrl-C too: never leave the claim to the sweep
        cause = (f"power {command} by {actor} via {target.bmc}: "
                 f"{_describe(error)}")
        with contextlib.suppress(bmdb.BMDBError):  # a lost session: the sweep releases it
            work.cancel(cause[:2000])
        if isinstance(error, PowerRefused | PowerError):
            raise PowerRefused(f"machine {target.machine_id}: {cause}; claim cancelled"
                               ) from None
        raise
    seconds = clock() - started
    work.note(POWER_EVENT, f"{command} by {actor} via {target.bmc}: verified after "
                           f"{seconds:.1f}s: {detail}")
    work.finish()
    return PowerResult(target.machine_id, command, target.bmc, power.value, detail,
                       round(seconds, 3), work.id, holds)


def set_boot_device(session: bmdb.Session, target: PowerTarget, device: BootDevice,
                    persistent: bool, actor: str,
                    clock: Callable[[], float] = time.monotonic) -> BootDeviceResult:
    """Claim the machine for ``Process.POWER`` (``NotClaimable`` when busy), set its
    next boot device and read it back, then finish; when the BMC fails, refuses, or
    reads back another device, cancel the claim with the cause and raise
    ``PowerRefused``."""
    asked = f"bootdev {device}{' persistent' if persistent else ''}"
    work = session.claim_machine(bmdb.Process.POWER, target.machine_id)
    started = clock()
    try:
        holds = session.transact(lambda tx: [h.kind for h in bmdb.holds_of(
            tx, target.machine_id)])
        refuse_if_mismatched(session, target.machine_id, target.power, f"power by {actor}")
        work.ensure_held()
        read = set_boot_and_verify(target.power, device, persistent=persistent)
    except BaseException as error:  # Ctrl-C too: never leave the claim to the sweep
        cause = f"{asked} by {actor} via {target.bmc}: {_describe(error)}"
        with contextlib.suppress(bmdb.BMDBError):  # a lost session: the sweep releases it
            work.cancel(cause[:2000])
        if isinstance(error, PowerError):
            raise PowerRefused(f"machine {target.machine_id}: {cause}; claim cancelled"
                               ) from None
        raise
    assert read.device is not None  # set_boot_and_verify checked it is ``device``
    seconds = clock() - started
    work.note(BOOT_DEVICE_EVENT, f"{asked} by {actor} via {target.bmc}: read back "
                                 f"{read.text} (raw: {read.raw})"[:2000])
    work.finish()
    return BootDeviceResult(target.machine_id, target.bmc, device.value, persistent,
                            read.device.value, read.persistent, read.text, read.raw,
                            round(seconds, 3), work.id, holds)


def _run(work: bmdb.Work, target: PowerTarget,
         steps: tuple[tuple[PowerAction, PowerState], ...], settings: LadderSettings,
         clock: Callable[[], float], sleep: Callable[[float], None]
         ) -> tuple[PowerState, str]:
    power = target.power
    for action, _ in steps:
        if not power.supports(action):
            raise PowerRefused(f"{power.description} does not offer {action.value}")
    if not power.reads_state:
        raise PowerRefused(f"{power.description} cannot read the power state, so a change "
                           "could not be verified")
    watch = Watch(power, Endpoint(target.machine.address, target.machine.ssh_port),
                  settings, clock, sleep)
    details = []
    state = PowerState.UNKNOWN
    for action, wanted in steps:
        if watch.state() is wanted:  # BMCs differ on "on" when on: do not ask them
            details.append(f"{action.value}: already {wanted.value}")
            state = wanted
            continue
        work.ensure_held()
        step_started = clock()
        power.act(action)
        reached, seen = watch.reaches(wanted, step_started)
        details.append(f"{action.value}: {seen}")
        if not reached:
            raise PowerRefused(f"not verified within {settings.rung_timeout:g}s: "
                               f"{'; '.join(details)}")
        state = wanted
    return state, "; ".join(details)


def _describe(error: BaseException) -> str:
    if isinstance(error, PowerRefused):
        return str(error)
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    return f"{type(error).__name__}: {error}"
