"""What every power driver offers Recovery and the operator, and the errors it raises.

A *power control* is one machine's power as its BMC (or its provider's API) lets us
see and change it. It sits beside the provider interface, not inside it: a machine
listed in a static inventory and a machine bought through an API are rebooted by
the same ladder (``shepherd.workflows.ladder``), whichever driver is behind it.

Acknowledged is not done: BMCs answer 200/204 to a reset that lands seconds later,
or never. Callers verify every change by observing it (``power_state`` polled, or
the SSH banner), never by the driver's answer alone.

Error messages name the BMC (``PowerControl.description``), never a password.
"""

from __future__ import annotations

import enum
from typing import Protocol, runtime_checkable

from shepherd.bmc import BmcAuthFailed, PowerError

__all__ = [
    "ActionUnsupported", "BmcAuthFailed", "BmcBusy", "BmcUnreachable", "PowerAction",
    "PowerControl", "PowerError", "PowerState",
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


class BmcUnreachable(PowerError):
    """No answer from the BMC (connection, timeout, 5xx) after the bounded retries."""


class ActionUnsupported(PowerError):
    """This BMC (or provider) cannot do that action (not advertised, 501, 400)."""


class BmcBusy(PowerError):
    """Another worker is talking to this BMC and did not finish within the wait."""


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
