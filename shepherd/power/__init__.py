"""Power control: a machine's BMC (Redfish, IPMI) or its provider's API reboot.

``connect(spec)`` gives the driver for an inventory's ``bmc`` table; wrap it in
``ExclusivePower`` wherever workers may call concurrently (Recovery, the CLI), so
a BMC sees one call at a time across the fleet. ``ProviderPower`` puts an API
reboot behind the same interface. Either takes a ``PowerRecorder`` (``recorder_for``) that
writes what it reads and asks to the BMDB (``bmdb.power_states``) for the web view. See
``base`` for the interface and its errors, ``bootdev`` for setting the next boot
device and reading it back (``set_boot_and_verify``), ``shepherd.bmc`` for the spec.
"""

from shepherd.bmc import DRIVERS, BmcSpec
from shepherd.power.base import (
    ActionUnsupported,
    BmcAuthFailed,
    BmcBusy,
    BmcSurvey,
    BmcUnreachable,
    BootDevice,
    BootDeviceNotTaken,
    BootOverride,
    Health,
    PowerAction,
    PowerControl,
    PowerError,
    PowerState,
    SystemIdentity,
)
from shepherd.power.bootdev import set_boot_and_verify
from shepherd.power.exclusive import ExclusivePower, singleton_name
from shepherd.power.ipmi import IpmiPower
from shepherd.power.provider import ProviderPower
from shepherd.power.recorded import IntentNotRecorded, PowerRecorder, recorder_for
from shepherd.power.redfish import RedfishPower

#: A BMC's own driver: a ``PowerControl`` that can also ``survey`` (``BmcDriver``).
BmcControl = RedfishPower | IpmiPower


def connect(spec: BmcSpec, *, timeout: float = 10.0, attempts: int = 3) -> BmcControl:
    """The driver for ``spec``: nothing is sent until its first call (so building
    one for every listed machine is free, and credentials are read per call)."""
    if spec.driver == "redfish":
        return RedfishPower(spec, timeout=timeout, attempts=attempts)
    if spec.driver == "ipmi":
        return IpmiPower(spec, timeout=timeout, attempts=attempts)
    raise ValueError(f"{spec.description}: unknown BMC driver {spec.driver!r} "
                     f"(known: {', '.join(DRIVERS)})")


__all__ = [
    "ActionUnsupported",
    "BmcAuthFailed",
    "BmcBusy",
    "BmcControl",
    "BmcSurvey",
    "BmcUnreachable",
    "BootDevice",
    "BootDeviceNotTaken",
    "BootOverride",
    "ExclusivePower",
    "Health",
    "IntentNotRecorded",
    "IpmiPower",
    "PowerAction",
    "PowerControl",
    "PowerError",
    "PowerRecorder",
    "PowerState",
    "ProviderPower",
    "RedfishPower",
    "SystemIdentity",
    "connect",
    "recorder_for",
    "set_boot_and_verify",
    "singleton_name",
]
