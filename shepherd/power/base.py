"""What every power driver offers Recovery and the operator, and the errors it raises.

A *power control* is one machine's power as its BMC (or its provider's API) lets us
see and change it. It sits beside the provider interface, not inside it: a machine
listed in a static inventory and a machine bought through an API are rebooted by
the same ladder (``shepherd.workflows.ladder``), whichever driver is behind it.

Acknowledged is not done: BMCs answer 200/204 to a reset that lands seconds later,
or never. Callers verify every change by observing it (``power_state`` polled, or
the SSH banner), never by the driver's answer alone.

The same holds for the boot device, with one more twist: a BMC can acknowledge a
boot-override change and keep the old one (some ignore the request, some map the
device to another, many ignore "persistent"). Installing an OS ends with "boot the
disk next": a machine that boots the network instead reinstalls itself. So a boot
device is always read back after it is set (``shepherd.power.bootdev``).

Error messages name the BMC (``PowerControl.description``), never a password.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from shepherd.bmc import BmcAuthFailed, PowerError

__all__ = [
    "ActionUnsupported", "BmcAuthFailed", "BmcBusy", "BmcSurvey", "BmcUnreachable",
    "BootDevice", "BootDeviceNotTaken", "BootOverride", "Health", "PowerAction",
    "PowerControl", "PowerError", "PowerState", "SystemIdentity",
]


class PowerState(enum.StrEnum):
    ON = "On"
    OFF = "Off"
    #: Powering on or off, or rebooting: a state in between.
    TRANSITIONING = "Transitioning"
    #: The driver cannot tell (no state at all, or one we do not recognise).
    UNKNOWN = "Unknown"


class PowerAction(enum.StrEnum):
    """The four actions of the reboot ladder, in the ladder's order."""

    GRACEFUL_RESTART = "graceful_restart"
    FORCE_RESTART = "force_restart"
    POWER_OFF = "power_off"
    POWER_ON = "power_on"


class BootDevice(enum.StrEnum):
    """Where the machine boots next: its installed system, a rescue system by network
    (PXE), or one from virtual media."""

    DISK = "disk"
    NETWORK = "network"
    CD = "cd"


@dataclass(frozen=True)
class BootOverride:
    """A BMC's boot override as read back from it."""

    #: None: no override, or one we do not map (BIOS setup, a floppy, a USB stick...).
    device: BootDevice | None
    #: True: every boot; False: the next one only; None: the BMC did not say.
    persistent: bool | None
    #: The BMC's own words ("Hdd (Continuous)", "hd, persistent"), for causes and logs.
    raw: str

    @property
    def text(self) -> str:
        """A short phrase for people: "disk (persistent)", "network (once)"."""
        if self.device is None:
            return f"no override (raw {self.raw})"
        if self.persistent is None:
            return f"{self.device} (persistence not reported)"
        return f"{self.device} ({'persistent' if self.persistent else 'once'})"


class BmcUnreachable(PowerError):
    """No answer from the BMC (connection, timeout, 5xx) after the bounded retries."""


class ActionUnsupported(PowerError):
    """This BMC (or provider) cannot do that action (not advertised, 501, 400)."""


class BmcBusy(PowerError):
    """Another worker is talking to this BMC and did not finish within the wait."""


@dataclass(frozen=True)
class SystemIdentity:
    """Who a machine says it is (its SMBIOS/DMI system information), as its BMC or its
    own agent reports it. A field is None where that side reports nothing; a value
    is passed on as read (placeholders like "Not Specified" are the comparison's to
    ignore: ``shepherd.power.identity``)."""

    uuid: str | None = None
    serial: str | None = None
    model: str | None = None


class Health(enum.StrEnum):
    """A system's health as its BMC judges it, in Redfish's words (``Status.Health``);
    an IPMI BMC's chassis faults are mapped onto them (``shepherd.power.ipmi``)."""

    OK = "OK"
    WARNING = "Warning"
    CRITICAL = "Critical"


@dataclass(frozen=True)
class BmcSurvey:
    """What one read of a BMC tells the power and health sync
    (``shepherd.workflows.bmc_sync``): the power, the health and the system's identity,
    read in as few requests as the protocol allows (a Redfish System read whole: the
    service root and the System; one IPMI session), because the sync reads every BMC of
    the fleet again and again."""

    power: PowerState
    #: None: the BMC reports no health at all (said as such, never guessed as OK).
    health: Health | None
    #: The BMC's own words behind ``health``, for people: "Status.Health OK, State
    #: Enabled"; "chassis: power fault, drive fault". At most a few hundred characters.
    health_detail: str
    identity: SystemIdentity
    #: How long the BMC took, as its driver measured it (an IPMI helper's own start
    #: left out); None: not measured, the caller times the call.
    seconds: float | None = None


class BootDeviceNotTaken(PowerError):
    """The BMC acknowledged a boot-device change, but reading it back shows another."""


@runtime_checkable
class PowerControl(Protocol):
    """One machine's power."""

    #: Names the BMC for causes and logs: driver, address, system; never credentials.
    description: str
    #: False when ``power_state`` can only answer UNKNOWN (an API reboot with no
    #: device state): verification then relies on the SSH banner alone.
    reads_state: bool

    def power_state(self) -> PowerState:
        """The machine's power now, as the BMC reports it."""
        ...

    def act(self, action: PowerAction) -> None:
        """Ask for ``action``; returns once the BMC acknowledged it (not once it is done)."""
        ...

    def supports(self, action: PowerAction) -> bool:
        """Whether ``act(action)`` can work at all (advertised by the BMC)."""
        ...

    def boot_device(self) -> BootOverride:
        """The boot override as the BMC reports it now: the only proof that a
        ``set_boot_device`` was taken (``shepherd.power.bootdev``)."""
        ...

    def identity(self) -> SystemIdentity:
        """The system the BMC manages, as it identifies it (Redfish ``UUID``,
        ``SerialNumber``, ``Model``; IPMI system GUID): what ``shepherd.power.identity``
        compares with the machine's own DMI to find a BMC wired to the wrong machine.
        Fields it does not report are None."""
        ...

    def set_boot_device(self, device: BootDevice, *, persistent: bool = False) -> None:
        """Ask the BMC to boot ``device`` next (every boot, with ``persistent``); returns
        once the BMC acknowledged it, which does not mean it took it: read it back
        with ``boot_device`` (``set_boot_and_verify`` does)."""
        ...
