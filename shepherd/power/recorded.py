"""Power controls that write down, in the BMDB, what they saw and what they asked.

Why: the web view shows each machine's power without ever calling a BMC or a
provider while rendering (a page of a thousand machines would be a thousand BMC
calls, and a BMC is slow and fragile). So the calls Shepherd makes anyway, Recovery's
reboot ladder and ``shepherd power``, leave their readings and acknowledged actions
in ``bmdb.power_states``, with the BMDB's clock, and the pages read them back.

Recording never changes the call's outcome: a reading or an action is returned or
raised exactly as without a recorder, and a failure to record (a lost session,
a busy BMDB) is logged, not raised. Each record is its own short transaction, made
after the call returned, never around it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

import bmdb
from shepherd.power.base import BootDevice, PowerAction, PowerState
from shepherd.providers.base import Provider

log = logging.getLogger(__name__)

#: Finds the machine's id in the BMDB (None: not known there, nothing is recorded).
MachineOf = Callable[[bmdb.Tx], uuid.UUID | None]


class PowerRecorder:
    """Writes one machine's readings and acknowledged actions to ``bmdb.power_states``.

    The power controls that Recovery and ``shepherd power`` use (``ExclusivePower``,
    ``ProviderPower``) take one (``recorder=``) and call it after each call returned;
    ``shepherd.runtime.power_for`` gives them one. The machine is found by
    ``machine_of`` once, at the first record.
    """

    def __init__(self, session: bmdb.Session, machine_of: MachineOf) -> None:
        self.session = session
        self.machine_of = machine_of
        self._machine: uuid.UUID | None = None

    def observed(self, state: PowerState, via: str) -> None:
        """Record a reading; ``Unknown`` says nothing and is not recorded."""
        if state is not PowerState.UNKNOWN:
            self._record(via, lambda tx, machine: bmdb.record_power_observed(
                tx, machine, state.value, via))

    def acted(self, action: PowerAction, via: str) -> None:
        """Record an action the power control acknowledged."""
        self._record(via, lambda tx, machine: bmdb.record_power_action(
            tx, machine, action.value, via))

    def boot_device_asked(self, device: BootDevice, persistent: bool, via: str) -> None:
        """Record a boot-device change the BMC acknowledged, as the last action
        ("boot_device disk (once)"): what was asked, not what was read back."""
        action = f"boot_device {device} ({'persistent' if persistent else 'once'})"
        self._record(via, lambda tx, machine: bmdb.record_power_action(
            tx, machine, action, via))

    def _record(self, via: str, write: Callable[[bmdb.Tx, uuid.UUID], object]) -> None:
        def body(tx: bmdb.Tx) -> None:
            if self._machine is None:
                self._machine = self.machine_of(tx)
            if self._machine is not None:
                write(tx, self._machine)

        try:
            self.session.transact(body)
        except Exception as error:  # the power call's own outcome matters more
            log.warning("%s: could not record the power state in the BMDB: %s: %s",
                        via, type(error).__name__, error)


def recorder_for(session: bmdb.Session, provider: Provider, provider_id: str
                 ) -> PowerRecorder:
    """A recorder for the machine whose Provided tag is ``provider``'s ``provider_id``
    (the provider's name is read at the first record, not now)."""
    return PowerRecorder(session, lambda tx: bmdb.provided_machine_id(
        tx, provider.name, provider_id))
