"""Set a machine's next boot device and prove the BMC took it, by reading it back.

Why read back: a BMC's acknowledgement (Redfish 204, IPMI completion code 0) says it
understood the request, not that it kept it. Some BMCs ignore a boot override, some
keep another device, and after an installation "boot the disk" not taken means the
machine boots the network and reinstalls itself. So the override is read back and a
different device is ``BootDeviceNotTaken``: the caller stops there.

Persistence is looser, on purpose. Asked "once" but read back "persistent" is
accepted: sushy-emulator keeps every override ``Continuous`` (it ignores
``BootSourceOverrideEnabled``), as do some real BMCs, and the device wanted is booted
next either way. Asked "persistent" but read back "once" (ipmi_sim, and many real
BMCs, do not keep IPMI's persistent bit) or not reported is accepted too, with a
warning in the log: the next boot, which is what an installation needs, is the
device wanted. The returned ``BootOverride`` always says what the BMC reported, so a
caller that needs more decides with the truth in hand.
"""

from __future__ import annotations

import logging

from shepherd.power.base import BootDevice, BootDeviceNotTaken, BootOverride, PowerControl

log = logging.getLogger(__name__)


def set_boot_and_verify(power: PowerControl, device: BootDevice, *,
                        persistent: bool = False) -> BootOverride:
    """Set ``device`` as the next boot (every boot with ``persistent``), then read it
    back: the override read, or ``BootDeviceNotTaken`` naming what was read instead."""
    device = BootDevice(device)
    power.set_boot_device(device, persistent=persistent)
    read = power.boot_device()
    if read.device is not device:
        raise BootDeviceNotTaken(f"{power.description}: boot device read back as "
                                 f"{_read_as(read)}, not {device}")
    if persistent and read.persistent is not True:
        log.warning("%s: asked %s persistent, the BMC reports %s: only the next boot "
                    "is sure to be %s", power.description, device, read.text, device)
    log.info("%s: boot device %s (raw: %s)", power.description, read.text, read.raw)
    return read


def _read_as(read: BootOverride) -> str:
    if read.device is None:
        return read.text
    return f"{read.device} (raw: {read.raw})"
