"""IPMI power control over ``pyghmi``, each call in a short-lived process of its own.

Why pyghmi: pure Python (no ``ipmitool`` binary on every worker, no password on
a command line), IPMI 2.0 / RMCP+ as BMCs speak it, hosted on OpenDev (it began as
an OpenStack project) and still released; OpenStack's virtualbmc and Lenovo's
Confluent are built on it.

Why a process per call: pyghmi keeps process-wide state, a background I/O thread,
a shared socket pool and a cache of logged-in sessions keyed by credentials, kept
open by a keepalive. Observed with pyghmi 1.6: a process forked after a call
(Celery's prefork pool forks) inherits that state without the thread, and its
next call hangs with no timeout; a session logged out and asked for again is
handed back broken from the cache; and a session not logged out holds one of the
BMC's few session slots for as long as the worker lives. A child per call
(``ipmi_call.py``: log in, one command, log out, exit) has none of that, and its
``timeout`` is a hard one: the child is killed. It costs about 0.3 s of
interpreter start, small beside a BMC's own pace. The password goes to the child
on stdin, never in argv.

``timeout`` is the BMC's time, counted by the child once it has started (its own
SIGALRM, ``ipmi_call.bound_the_bmc_time``): a loaded worker host stretches the
child's start to seconds, and that must not read as a BMC that does not answer (which
stops Recovery's ladder and marks the BMC unreachable). The parent still kills a
child that has not answered within ``timeout`` plus ``HELPER_START``.

IPMI has no graceful restart (only a soft power-off): ``supports`` says so and
``act`` raises ``ActionUnsupported``; the ladder goes on to a force restart.

The boot device is the boot flags parameter (5) of the system boot options, set by
pyghmi's ``set_bootdev``. It is read with the same request as pyghmi's
``get_bootdev``, but decoded as ``ipmitool chassis bootparam get 5`` and Ironic's
ipmitool driver do: the device selector, whatever the flags' "valid" bit says.
pyghmi reads a clear valid bit as "no override", and OpenIPMI's ``ipmi_sim`` keeps
only the selector (it asks its chassis program for it on each read, with the flags
byte zero), so pyghmi would read every change there as not taken. The bit is kept in
``BootOverride.raw`` ("flags not valid") for whoever reads a cause. IPMI's
persistent bit is reported as read; many BMCs (ipmi_sim too) never keep it.

The identity is the system GUID (Get System GUID), read in the byte order Linux
shows in ``/sys/class/dmi/id/product_uuid`` (``ipmi_call.system_guid`` says why),
and the serial number and model of FRU device 0's product area, the fields Linux
shows as ``product_serial`` and ``product_name`` (``ipmi_call.fru_product`` says why
not the board's). Each is None where the BMC has none to give.

``survey`` reads the power, the health and the identity in one child and one IPMI
session (Get Chassis Status, Get System GUID, a few FRU reads): the power and health
sync asks it of every BMC again and again, and a session costs more round trips than
the reads in it. IPMI has no health of its own; the chassis status's fault bits are
mapped onto one (``chassis_health``). ``identity`` is the same read, one way of
reading a BMC: the FRU serial (what decides a mismatch where the GUID cannot) costs
a few commands more in a session that is opened anyway, no second login.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shepherd.power.base import (
    ActionUnsupported,
    BmcAuthFailed,
    BmcSurvey,
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

CHILD = Path(__file__).with_name("ipmi_call.py")
#: Seconds a child may take to start (an interpreter and pyghmi's imports) beyond
#: ``timeout``: seconds on a loaded host, a fraction of one otherwise.
HELPER_START = 20.0
#: What each action sends (IPMI chassis control); GRACEFUL_RESTART has no IPMI form.
OPERATIONS: dict[PowerAction, str] = {
    PowerAction.FORCE_RESTART: "reset",
    PowerAction.POWER_OFF: "off",
    PowerAction.POWER_ON: "on",
}
POWER_STATES = {"on": PowerState.ON, "off": PowerState.OFF}
#: pyghmi's boot device names (``set_bootdev``), each way.
BOOT_NAMES: dict[BootDevice, str] = {
    BootDevice.DISK: "hd", BootDevice.NETWORK: "network", BootDevice.CD: "optical",
}
BOOT_DEVICES = {name: device for device, name in BOOT_NAMES.items()}
#: Chassis faults (``ipmi_call.CHASSIS_FAULTS``' names) that make a system Critical;
#: every other one makes it Warning (``chassis_health`` says why).
CRITICAL_FAULTS = frozenset({"power fault", "power overload", "power control fault",
                             "cooling fault"})


def chassis_health(faults: Sequence[str]) -> Health:
    """The health a chassis status's faults mean, as a Redfish BMC would judge them.

    Critical: the system cannot run, or cannot be trusted to: its main power failed
    (power fault), it was shut down by an overload (power overload), the BMC's own
    power changes do not take (power control fault: every power action of Recovery
    rests on them), or its cooling failed (cooling fault: a thermal shutdown, or
    damage, is next).
    Warning: the system runs but wants a person: a drive fault (one drive of many,
    often redundant; the bit does not say which), an open chassis (chassis intrusion)
    or an active panel interlock (both a person's doing more than a failure's).
    A name not known here is Warning too: reported, never taken for OK.
    """
    if any(fault in CRITICAL_FAULTS for fault in faults):
        return Health.CRITICAL
    return Health.WARNING if faults else Health.OK


def chassis_detail(faults: Sequence[str]) -> str:
    """``BmcSurvey.health_detail``: "chassis status: no fault" or the faults, by name."""
    return f"chassis status: {', '.join(faults) if faults else 'no fault'}"


class IpmiPower(BmcDriver):
    """One machine's power through its IPMI BMC (``spec.driver == "ipmi"``, UDP ``spec.port``).

    ``timeout`` bounds each attempt's time with the BMC (the child process ends after
    it, its own start not counted);
    ``attempts`` how many times a call is tried when the BMC does not answer,
    ``backoff`` seconds apart at first (doubling).
    """

    DRIVER = "ipmi"

    # -- PowerControl --------------------------------------------------------

    def power_state(self) -> PowerState:
        answer = self._call("read the power state", "status")
        return POWER_STATES.get(str(answer.get("power")), PowerState.UNKNOWN)

    def supports(self, action: PowerAction) -> bool:
        """Chassis control is mandatory in IPMI 2.0, and there is nothing to ask:
        only GRACEFUL_RESTART, which IPMI lacks, is unsupported."""
        return action in OPERATIONS

    def act(self, action: PowerAction) -> None:
        operation = OPERATIONS.get(action)
        if operation is None:
            raise ActionUnsupported(f"{self.description}: IPMI has no {action} "
                                    f"(only power on, off, reset and soft off)")
        self._call(f"{action} (chassis power {operation})", operation)
        log.info("%s: %s acknowledged", self.description, action)

    def boot_device(self) -> BootOverride:
        answer = self._call("read the boot flags", "bootdev_get")
        name, persistent = answer.get("bootdev"), bool(answer.get("persistent"))
        raw = f"{name}, {'persistent' if persistent else 'once'}"
        if not answer.get("valid"):
            raw += ", flags not valid"
        raw += f" (boot flags {answer.get('data')})"
        device = BOOT_DEVICES.get(str(name))
        # "default"/"none" (selector 0) is no override, whatever the persistent bit says.
        return BootOverride(device, persistent if device is not None else None, raw)

    def identity(self) -> SystemIdentity:
        """The survey's identity (``survey``): the system GUID as a UUID string in
        SMBIOS/DMI byte order (as in ``/sys/class/dmi/id/product_uuid``; see
        ``ipmi_call.system_guid``) and FRU device 0's product serial and name, each
        passed on as read (an all-zero GUID too) or None where the BMC gives none."""
        return self._survey("read the system identity").identity

    def survey(self) -> BmcSurvey:
        """Power, health and identity in one child process and one IPMI session; the
        health is the chassis status's faults (``chassis_health``)."""
        return self._survey("survey power, health and identity")

    def set_boot_device(self, device: BootDevice, *, persistent: bool = False) -> None:
        name = BOOT_NAMES[device]
        what = f"set the boot device {device} ({name}{', persistent' if persistent else ''})"
        self._call(what, "bootdev_set", {"device": name, "persistent": persistent})
        log.info("%s: boot device %s (%s, %s) acknowledged", self.description, device, name,
                 "persistent" if persistent else "once")

    # -- plumbing ----------------------------------------------------------------

    def _survey(self, what: str) -> BmcSurvey:
        answer = self._call(what, "survey")
        faults = [str(fault) for fault in answer.get("faults") or []]

        def text(field: str) -> str | None:
            value = answer.get(field)
            return str(value) if value else None

        return BmcSurvey(power=POWER_STATES.get(str(answer.get("power")), PowerState.UNKNOWN),
                         health=chassis_health(faults), health_detail=chassis_detail(faults),
                         identity=SystemIdentity(uuid=text("uuid"), serial=text("serial"),
                                                 model=text("model")),
                         seconds=_seconds(answer.get("seconds")))

    def _call(self, what: str, op: str, fields: dict[str, Any] | None = None
              ) -> dict[str, Any]:
        return self.retried(what, lambda: self._once(what, op, fields or {}))

    def _once(self, what: str, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        password = self.spec.read_password()
        request = {**fields, "host": self.spec.address, "port": self.spec.port,
                   "username": self.spec.username, "password": password, "op": op,
                   "timeout": self.timeout}
        limit = self.timeout + HELPER_START
        try:
            child = subprocess.run([sys.executable, "-P", str(CHILD)], input=json.dumps(request),
                                   capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            raise Transient(f"no answer within {limit:g}s, the helper's start "
                            "included") from None
        if child.returncode == -signal.SIGALRM:  # the child's own bound on the BMC
            raise Transient(f"no answer within {self.timeout:g}s")
        try:
            answer = json.loads(child.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            # Never echo the child's output: it could hold anything. Its exit code
            # and the last line of stderr (a traceback's last line) are enough.
            tail = (child.stderr.strip().splitlines() or ["no output"])[-1]
            tail = tail.replace(password, "***")
            raise PowerError(f"{self.description}: {what}: the IPMI helper failed "
                             f"(exit {child.returncode}): {tail[:200]}") from None
        kind = answer.get("error")
        if kind is None:
            return dict(answer)
        detail = f"{self.description}: {what}: {answer.get('message') or kind}"
        if kind == "auth":
            raise BmcAuthFailed(f"{detail} (user {self.spec.username!r})")
        if kind == "unreachable":
            raise Transient(str(answer.get("message") or "no answer"))
        if kind == "unsupported":
            raise ActionUnsupported(detail)
        raise PowerError(detail)


def _seconds(value: object) -> float | None:
    """The helper's own measure of the session, when it sent a number."""
    return float(value) if isinstance(value, int | float) else None
