"""A provider's API reboot as one more power control (Equinix client, the simulator).

So the reboot ladder treats a machine bought through an API like one behind a
BMC: the API reboot is both restart rungs, verified through the device state the
provider reports (Equinix shows a rebooting device as powering on, i.e. STOPPED,
then active). An API offers no power off or on of its own here, so those rungs
are unsupported and the ladder ends after the restart. Nor does an API offer a boot
device: both boot-device calls are ``ActionUnsupported``.

Provider errors become power errors, so the ladder has one family to handle:
exhausted retries are ``BmcUnreachable``, a refused token ``BmcAuthFailed``.
"""

from __future__ import annotations

import bmdb
from shepherd.power.base import (
    ActionUnsupported,
    BmcAuthFailed,
    BmcUnreachable,
    BootDevice,
    BootOverride,
    PowerAction,
    PowerError,
    PowerState,
    SystemIdentity,
)
from shepherd.power.recorded import PowerRecorder, act_recorded
from shepherd.providers.base import (
    NotSupported,
    PermanentError,
    Provider,
    ProviderError,
    TransientExhausted,
)

RESTARTS = frozenset({PowerAction.GRACEFUL_RESTART, PowerAction.FORCE_RESTART})
POWER_STATES = {
    bmdb.ProviderStatus.RUNNING: PowerState.ON,
    bmdb.ProviderStatus.STOPPED: PowerState.OFF,
    bmdb.ProviderStatus.PROVISIONING: PowerState.TRANSITIONING,
}


class ProviderPower:
    """Machine ``provider_id``'s power through ``provider``'s API.

    ``reads_state``: False for a provider whose machines report no state (the
    ladder then verifies by the SSH banner alone). ``recorder``: where each reading
    and each reboot (asked before the call, its outcome after) is recorded
    (``shepherd.power.recorded``), if anywhere.
    """

    def __init__(self, provider: Provider, provider_id: str, *, reads_state: bool = True,
                 recorder: PowerRecorder | None = None) -> None:
        self.provider = provider
        self.recorder = recorder
        self.provider_id = provider_id
        self.reads_state = reads_state
        self.description = f"provider {provider.name} device {provider_id}"

    def __repr__(self) -> str:
        return f"ProviderPower({self.description})"

    def power_state(self) -> PowerState:
        if not self.reads_state:
            return PowerState.UNKNOWN
        try:
            status = self.provider.get_machine(self.provider_id).status
        except ProviderError as error:
            raise self._mapped("read the device state", error) from None
        state = POWER_STATES.get(status, PowerState.UNKNOWN)
        if self.recorder is not None:
            self.recorder.observed(state, self.description)
        return state

    def supports(self, action: PowerAction) -> bool:
        return action in RESTARTS

    def act(self, action: PowerAction) -> None:
        """The API's reboot, its intent recorded before the call (``recorded``)."""
        if action not in RESTARTS:
            raise ActionUnsupported(f"{self.description}: the API offers a reboot, "
                                    f"not {action}")
        act_recorded(self.recorder, action, self.description, lambda: self._reboot(action))

    def _reboot(self, action: PowerAction) -> None:
        try:
            self.provider.reboot(self.provider_id)
        except NotSupported as error:
            raise ActionUnsupported(f"{self.description}: {error}") from None
        except ProviderError as error:
            raise self._mapped(f"{action} (API reboot)", error) from None

    def identity(self) -> SystemIdentity:
        """Nothing: a provider's API names its device, not the system behind it."""
        return SystemIdentity()

    def boot_device(self) -> BootOverride:
        raise ActionUnsupported(f"{self.description}: the API offers no boot device")

    def set_boot_device(self, device: BootDevice, *, persistent: bool = False) -> None:
        raise ActionUnsupported(f"{self.description}: the API offers no boot device "
                                f"(asked {device})")

    def _mapped(self, what: str, error: ProviderError) -> PowerError:
        detail = f"{self.description}: {what}: {error}"
        if isinstance(error, TransientExhausted):
            return BmcUnreachable(detail)
        if isinstance(error, PermanentError) and error.status in (401, 403):
            return BmcAuthFailed(detail)
        if isinstance(error, NotSupported):
            return ActionUnsupported(detail)
        return PowerError(detail)
