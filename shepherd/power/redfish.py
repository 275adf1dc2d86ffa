"""Redfish power control over ``sushy``, the client OpenStack Ironic drives real fleets with.

Why sushy rather than raw ``requests``: it finds the reset action's advertised
``target`` and ``AllowableValues`` (BMCs differ on both) and carries years of
vendor workarounds. What we add: short timeouts, our own bounded retries
(tenacity) in place of sushy's (up to 10 retries, 3 s apart, by default), and the
mapping of its errors onto ``shepherd.power.base``'s.

The boot device is ``Boot.BootSourceOverrideTarget`` (disk ``Hdd``, network ``Pxe``,
cd ``Cd``), ``Once`` or ``Continuous``, PATCHed through sushy and read back by a call
of its own (a fresh client, a fresh GET): what the BMC kept, not what we sent.

The identity is the System's ``UUID``, ``SerialNumber`` and ``Model``, trimmed and
otherwise as sent: whether it matches the machine is ``shepherd.power.identity``'s call.

A survey (``survey``: power, health, identity) is one call, so two requests: the
service root, which ``sushy.Sushy`` reads as it is built (the Redfish version its
resources are parsed by), and the System. Its health is the worse of the System's
``Status.Health`` (the resource's own) and ``Status.HealthRollup`` (which includes
its subordinates: processors, memory, drives, fans, power supplies on most BMCs):
a failed DIMM is the machine's fault for a fleet's health, and a rollup that says OK
while the System itself warns still warns.

Each call opens a fresh client, reads the password at that moment (a rotated
secret takes effect at once), and closes it. HTTP Basic, not a Redfish session:
a session per call costs two more requests, and one left behind by a killed
worker holds one of the few session slots a BMC has until it times out.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import requests
import sushy
from sushy import auth as sushy_auth
from sushy import exceptions as sushy_errors

from shepherd.power.base import (
    ActionUnsupported,
    BmcAuthFailed,
    BmcSurvey,
    BmcUnreachable,
    BootDevice,
    BootOverride,
    Health,
    PowerAction,
    PowerError,
    PowerState,
    SystemIdentity,
)
from shepherd.power.driver import BmcDriver, Transient

log = logging.getLogger(__name__)
T = TypeVar("T")

RESET_TYPES: dict[PowerAction, sushy.ResetType] = {
    PowerAction.GRACEFUL_RESTART: sushy.ResetType.GRACEFUL_RESTART,
    PowerAction.FORCE_RESTART: sushy.ResetType.FORCE_RESTART,
    PowerAction.POWER_OFF: sushy.ResetType.FORCE_OFF,
    PowerAction.POWER_ON: sushy.ResetType.ON,
}
POWER_STATES: dict[sushy.PowerState, PowerState] = {
    sushy.PowerState.ON: PowerState.ON,
    sushy.PowerState.OFF: PowerState.OFF,
    sushy.PowerState.POWERING_ON: PowerState.TRANSITIONING,
    sushy.PowerState.POWERING_OFF: PowerState.TRANSITIONING,
}

BOOT_TARGETS: dict[BootDevice, sushy.BootSource] = {
    BootDevice.DISK: sushy.BootSource.HDD,
    BootDevice.NETWORK: sushy.BootSource.PXE,
    BootDevice.CD: sushy.BootSource.CD,
}
BOOT_DEVICES = {target.value: device for device, target in BOOT_TARGETS.items()}
#: BootSourceOverrideEnabled as persistence; "Disabled" means no override at all.
PERSISTENCE = {sushy.BootSourceOverrideEnabled.CONTINUOUS.value: True,
               sushy.BootSourceOverrideEnabled.ONCE.value: False}

#: The ``Status`` keys a health is read from, in this order: the System's own, then its
#: rollup, as the standard spells it and as some BMCs (sushy-emulator among them) do.
HEALTH_KEYS = ("Health", "HealthRollup", "HealthRollUp")
#: Worst last: the survey's health is the worst of the keys that map.
HEALTH_ORDER = (Health.OK, Health.WARNING, Health.CRITICAL)


class RedfishPower(BmcDriver):
    """One machine's power through its Redfish BMC (``spec.driver == "redfish"``).

    ``timeout`` bounds each HTTP request (connect and read); ``attempts`` how many
    times a call is tried when the BMC does not answer or answers 5xx, ``backoff``
    seconds apart at first (doubling). A call thus ends within about
    ``attempts * (a few requests * timeout) + backoff * 2**attempts``.
    """

    DRIVER = "redfish"
    #: The system the BMC listed alone, once discovered (when ``spec.system`` is None).
    discovered: str | None = None

    @property
    def system_path(self) -> str | None:
        """The system's path, once known: configured, or discovered on the first call."""
        return self.spec.system or self.discovered

    # -- PowerControl --------------------------------------------------------

    def power_state(self) -> PowerState:
        state = self._call("read the power state", lambda system: system.power_state)
        return POWER_STATES.get(state, PowerState.UNKNOWN)

    def supports(self, action: PowerAction) -> bool:
        allowed = self._call("read the allowed resets", self._allowed)
        return RESET_TYPES[action] in allowed

    def act(self, action: PowerAction) -> None:
        reset = RESET_TYPES[action]

        def body(system: Any) -> None:
            allowed = self._allowed(system)
            if reset not in allowed:
                raise ActionUnsupported(
                    f"{self.description}: {action} (ResetType {reset.value}) is not advertised; "
                    f"the BMC allows {', '.join(sorted(v.value for v in allowed)) or 'none'}")
            system.reset_system(reset)

        self._call(f"{action} (ResetType {reset.value})", body)
        log.info("%s: %s acknowledged", self.description, action)

    def boot_device(self) -> BootOverride:
        return self._call("read the boot override", _boot_override)

    def identity(self) -> SystemIdentity:
        return self._call("read the system's identity", _identity)

    def survey(self) -> BmcSurvey:
        """Power, health and identity from one GET of the System (after sushy's read
        of the service root): the sync calls this on every BMC of the fleet, again
        and again. Timed here, around the requests: the BMC's time, retries included."""
        started = time.monotonic()
        surveyed = self._call("survey the system", _survey)
        return dataclasses.replace(surveyed, seconds=time.monotonic() - started)

    def set_boot_device(self, device: BootDevice, *, persistent: bool = False) -> None:
        target = BOOT_TARGETS[device]
        enabled = (sushy.BootSourceOverrideEnabled.CONTINUOUS if persistent
                   else sushy.BootSourceOverrideEnabled.ONCE)
        what = f"set the boot device {device} ({target.value}, {enabled.value})"
        self._call(what, lambda system: self._set_boot(system, target, enabled))
        log.info("%s: boot device %s (%s, %s) acknowledged", self.description, device,
                 target.value, enabled.value)

    # -- plumbing ----------------------------------------------------------------

    def _set_boot(self, system: Any, target: sushy.BootSource,
                  enabled: sushy.BootSourceOverrideEnabled) -> None:
        """PATCH the override. A BMC that refuses ``Once`` (400: some offer only
        ``Continuous``) is asked again with ``Continuous``: the next boot is what
        matters, and the read back says what it kept."""
        try:
            system.set_system_boot_options(target=target, enabled=enabled)
        except sushy_errors.InvalidParameterValueError as error:
            raise ActionUnsupported(f"{self.description}: boot device {target.value}: "
                                    f"{_short(error)}") from None
        except sushy_errors.HTTPError as error:
            if error.status_code != 400 or enabled is not sushy.BootSourceOverrideEnabled.ONCE:
                raise
            log.warning("%s: the BMC refused a boot override Once (HTTP 400 %s); asking "
                        "Continuous", self.description, _short(error))
            system.set_system_boot_options(
                target=target, enabled=sushy.BootSourceOverrideEnabled.CONTINUOUS)

    @staticmethod
    def _allowed(system: Any) -> set[sushy.ResetType]:
        try:
            return set(system.get_allowed_reset_system_values())
        except sushy_errors.MissingActionError:
            return set()

    def _call(self, what: str, body: Callable[[Any], T]) -> T:
        return self.retried(what, lambda: self._once(what, body))

    def _once(self, what: str, body: Callable[[Any], T]) -> T:
        password = self.spec.read_password()
        root = None
        try:
            root = sushy.Sushy(
                self.spec.address.rstrip("/"),
                auth=sushy_auth.BasicAuth(username=self.spec.username, password=password),
                verify=self.spec.ca_file or self.spec.verify_tls,
                read_timeout=self.timeout, connect_timeout=self.timeout,
                # Ours are the retries: sushy's would add up to 10 x 3 s per request.
                server_side_retries=1, server_side_retries_delay=0.1,
            )
            return body(root.get_system(self._system(root)))
        except PowerError:
            raise
        except sushy_errors.ConnectionError as error:
            if isinstance(error.__context__, requests.exceptions.SSLError):
                raise BmcUnreachable(f"{self.description}: {what}: TLS failed "
                                     f"(verify_tls/ca_file?): {_short(error)}") from None
            raise Transient(_short(error)) from None
        except sushy_errors.HTTPError as error:
            raise self._mapped(what, error) from None
        except sushy_errors.SushyError as error:
            raise PowerError(f"{self.description}: {what}: {_short(error)}") from None
        finally:
            if root is not None:
                root._conn.close()

    def _mapped(self, what: str, error: sushy_errors.HTTPError) -> Exception:
        status = error.status_code
        detail = f"{what}: HTTP {status} {error.detail or ''}".rstrip()
        if status in (401, 403):
            return BmcAuthFailed(f"{self.description}: {detail} (user {self.spec.username!r})")
        if status in (400, 405, 501):
            return ActionUnsupported(f"{self.description}: {detail}")
        if status == 404:
            return PowerError(f"{self.description}: {detail}: no such resource "
                              f"({self.system_path or 'the systems collection'})")
        if status is not None and status >= 500:
            return Transient(detail)
        return PowerError(f"{self.description}: {detail}")

    def _system(self, root: Any) -> str:
        """The system's path: configured, or the BMC's only one (discovered once)."""
        path = self.system_path
        if path is None:
            members = sorted(root.get_system_collection().members_identities)
            if len(members) != 1:
                listed = f": {', '.join(members)}" if members else ""
                raise PowerError(f"{self.description}: the BMC lists {len(members)} systems"
                                 f"{listed}; set bmc.system to the machine's")
            path = self.discovered = members[0]
        return path


def _boot_override(system: Any) -> BootOverride:
    """The override in the system's ``Boot`` as the BMC sent it (``system`` was just
    fetched: ``_once`` builds a fresh client per call). Read from the JSON rather than
    sushy's mapped fields: a value sushy does not know is kept in ``raw``, not lost."""
    boot = system.json.get("Boot") or {}
    target = boot.get("BootSourceOverrideTarget")
    enabled = boot.get("BootSourceOverrideEnabled")
    raw = f"{target or 'no target'} ({enabled or 'enabled not reported'})"
    if enabled == sushy.BootSourceOverrideEnabled.DISABLED.value:
        return BootOverride(None, None, raw)
    return BootOverride(BOOT_DEVICES.get(str(target)), PERSISTENCE.get(str(enabled)), raw)


def _identity(system: Any) -> SystemIdentity:
    """The System's ``UUID``, ``SerialNumber`` and ``Model`` as the BMC sent them,
    trimmed. Placeholders ("Not Specified", all-zero UUIDs) are kept: judging them is
    the comparison's (``shepherd.power.identity``), which sees both sides."""
    return SystemIdentity(uuid=_reported(system.uuid), serial=_reported(system.serial_number),
                          model=_reported(system.model))


def _survey(system: Any) -> BmcSurvey:
    """The power as ``power_state`` maps it; the health and its words from the JSON
    (``_health``), not sushy's mapped ``status``: that drops a value it does not know
    ("Degraded", "ok") and reads no ``HealthRollUp``."""
    health, detail = _health(system.json.get("Status"))
    return BmcSurvey(power=POWER_STATES.get(system.power_state, PowerState.UNKNOWN),
                     health=health, health_detail=detail, identity=_identity(system))


def _health(status: object) -> tuple[Health | None, str]:
    """The worst health ``status`` reports (``HEALTH_KEYS``), and the BMC's words for
    it: "Status.Health OK, HealthRollup Warning, State Enabled". A value that is not a
    Redfish health is shown, not counted; with none that is, the health is None."""
    fields = status if isinstance(status, dict) else {}
    reported = [(key, fields[key]) for key in (*HEALTH_KEYS, "State")
                if fields.get(key) is not None]
    healths = [_known_health(value) for key, value in reported if key in HEALTH_KEYS]
    known = [health for health in healths if health is not None]
    words = ", ".join(f"{key} {_word(value)}" for key, value in reported)
    if known:
        return max(known, key=HEALTH_ORDER.index), _short(f"Status.{words}")
    if words:
        return None, _short(f"the BMC reports no health: Status.{words}")
    return None, ("the BMC reports no health (no Status)" if status is None
                  else "the BMC reports no health (nothing in Status)")


def _known_health(value: object) -> Health | None:
    """``value`` as a Redfish health, whatever its case ("ok" is OK); None otherwise."""
    text = str(value).strip().casefold()
    return next((h for h in HEALTH_ORDER if h.value.casefold() == text), None)


def _word(value: object) -> str:
    """A value of the BMC's, short and on one line, for ``health_detail``."""
    return _short(str(value), limit=60)


def _reported(value: object) -> str | None:
    """``value`` without surrounding whitespace; None when absent or blank, as a BMC
    that sends ``""`` or ``" "`` reports nothing."""
    text = "" if value is None else str(value).strip()
    return text or None


def _short(error: object, limit: int = 300) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
