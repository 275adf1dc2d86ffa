"""Power controls that write down, in the BMDB, what they saw and what they asked.

Why: the web view shows each machine's power without ever calling a BMC or a
provider while rendering (a page of a thousand machines would be a thousand BMC
calls, and a BMC is slow and fragile). So the calls Shepherd makes anyway, Recovery's
reboot ladder and ``shepherd power``, leave their readings and acknowledged actions
in ``bmdb.power_states``, with the BMDB's clock, and the pages read them back.

Recording never changes a reading's outcome: it is returned or raised exactly as
without a recorder, and a failure to record it (a lost session, a busy BMDB) is
logged, not raised. An action is different: its intent is recorded *before* the
call (``asking``), in history too, and an action whose intent cannot be written is
not made (``IntentNotRecorded``). So a worker killed right after a reset still
leaves it in history and ``shepherd show``, and the next attempt does not reset
again at once (``shepherd.workflows.recoverer``). Each record is its own short
transaction, made before or after the call, never around it, and outside the BMC's
fleet-wide lock.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

import bmdb
from shepherd.power.base import BootDevice, PowerAction, PowerError, PowerState
from shepherd.providers.base import Provider

log = logging.getLogger(__name__)

#: Finds the machine's id in the BMDB (None: not known there, nothing is recorded).
MachineOf = Callable[[bmdb.Tx], uuid.UUID | None]


class IntentNotRecorded(PowerError):
    """The BMDB did not take a power action's intent: the action was not asked."""


class PowerRecorder:
    """Writes one machine's readings and acknowledged actions to ``bmdb.power_states``.

    The power controls that Recovery and ``shepherd power`` use (``ExclusivePower``,
    ``ProviderPower``) take one (``recorder=``) and call it before each action
    (``asking``) and after each call returned;
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

    def asking(self, action: PowerAction, via: str) -> None:
        """Record, in the power state and history, that ``action`` is about to be asked:
        call it before the call, and make no call if it raises ``IntentNotRecorded``."""
        def body(tx: bmdb.Tx) -> None:
            machine = self._machine_in(tx)
            if machine is not None:
                bmdb.record_power_asked(tx, machine, action.value, via)

        try:
            self.session.transact(body)
        except Exception as error:
            raise IntentNotRecorded(f"{via}: {action} not asked: its intent could not be "
                                    f"recorded in the BMDB ({type(error).__name__}: "
                                    f"{error})") from error

    def acted(self, action: PowerAction, via: str) -> None:
        """Record an action the power control acknowledged."""
        self._record(via, lambda tx, machine: bmdb.record_power_action(
            tx, machine, action.value, via))

    def failed(self, action: PowerAction, via: str) -> None:
        """Record that asking ``action`` failed (the error itself is the caller's)."""
        self._record(via, lambda tx, machine: bmdb.record_power_action(
            tx, machine, action.value, via, "failed"))

    def boot_device_asked(self, device: BootDevice, persistent: bool, via: str) -> None:
        """Record a boot-device change the BMC acknowledged, as the last action
        ("boot_device disk (once)"): what was asked, not what was read back."""
        action = f"boot_device {device} ({'persistent' if persistent else 'once'})"
        self._record(via, lambda tx, machine: bmdb.record_power_action(
            tx, machine, action, via))

    def _machine_in(self, tx: bmdb.Tx) -> uuid.UUID | None:
        if self._machine is None:
            self._machine = self.machine_of(tx)
        return self._machine

    def _record(self, via: str, write: Callable[[bmdb.Tx, uuid.UUID], object]) -> None:
        def body(tx: bmdb.Tx) -> None:
            machine = self._machine_in(tx)
            if machine is not None:
                write(tx, machine)

        try:
            self.session.transact(body)
        except Exception as error:  # the power call's own outcome matters more
            log.warning("%s: could not record the power state in the BMDB: %s: %s",
                        via, type(error).__name__, error)


def act_recorded(recorder: PowerRecorder | None, action: PowerAction, via: str,
                 call: Callable[[], None]) -> None:
    """``call`` (which asks ``action`` of ``via``), its intent recorded before it and
    its outcome after; ``call`` alone without a recorder. The one way power controls
    act, so no action skips its intent."""
    if recorder is None:
        call()
        return
    recorder.asking(action, via)
    try:
        call()
    except BaseException:
        recorder.failed(action, via)
        raise
    recorder.acted(action, via)


def recorder_for(session: bmdb.Session, provider: Provider, provider_id: str
                 ) -> PowerRecorder:
    """A recorder for the machine whose Provided tag is ``provider``'s ``provider_id``
    (the provider's name is read at the first record, not now)."""
    return PowerRecorder(session, lambda tx: bmdb.provided_machine_id(
        tx, provider.name, provider_id))
