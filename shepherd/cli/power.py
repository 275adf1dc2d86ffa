"""``shepherd power status|on|off|cycle MACHINE``: the machine's power through the
drivers Recovery uses (its BMC from the inventory, else its provider's reboot API);
``shepherd power bootdev MACHINE disk|network|cd [--persistent]``: the device it boots
next, set and read back from its BMC.

Unlike ``start``, this runs in the CLI process, not in a worker: an operator at a
console wants the BMC's answer now, and the BMDB claim (``Process.POWER``, in the
agent group) gives the same exclusion a worker would have. The work lives in
``shepherd.operations.power``; this module maps its outcomes to exit statuses: 0 done
and verified, 1 refused (busy) or failed (the BMC, a timeout, a boot device read back
as another), 2 a bad argument (checked before anything is asked of the BMDB or BMC).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import bmdb
from shepherd import operations
from shepherd.cli import render
from shepherd.cli.actions import actor
from shepherd.cli.context import Context, Failed
from shepherd.operations import power as operator_power
from shepherd.power import BootDevice
from shepherd.runtime import recoverer_settings


def power(ctx: Context) -> int:
    command = ctx.args.command
    _check_arguments(command, ctx.args)
    machine_id = ctx.machine_id()
    runtime = ctx.runtime
    who = actor(ctx)
    try:
        target = operator_power.locate(runtime.session, lambda: runtime.provider,
                                       runtime.power_for, machine_id)
        if command == "status":
            status = operator_power.read_status(target)
            ctx.emit(status, lambda: render.power_status(status))
            return 0
        if command == "bootdev":
            boot = operator_power.set_boot_device(runtime.session, target,
                                                  BootDevice(ctx.args.device),
                                                  ctx.args.persistent, who)
            ctx.emit(boot, lambda: boot_device_text(boot))
            return 0
        ladder = recoverer_settings(ctx.settings).ladder
        if ctx.args.wait is not None:
            ladder = dataclasses.replace(ladder, rung_timeout=ctx.args.wait)
        result = operator_power.change(runtime.session, target, command, ladder, who)
    except (operator_power.PowerRefused, bmdb.NotClaimable) as error:
        raise Failed(str(error)) from None
    ctx.emit(result, lambda: render.power_result(result))
    return 0


def _check_arguments(command: str, args: Any) -> None:
    """DEVICE and --persistent belong to bootdev, --wait to the power changes: a wrong
    mix is refused before anything is asked (argparse checks each value alone)."""
    if command == "bootdev":
        if args.device is None:
            raise operations.BadArgument(
                f"power bootdev needs a DEVICE: {', '.join(operator_power.BOOT_DEVICES)}")
        if args.wait is not None:
            raise operations.BadArgument("--wait is for power on, off and cycle: bootdev "
                                         "reads the boot device back at once")
        return
    if args.device is not None:
        raise operations.BadArgument(f"power {command} takes no DEVICE ({args.device!r}); "
                                     "only power bootdev does")
    if args.persistent:
        raise operations.BadArgument(f"--persistent is for power bootdev, not power "
                                     f"{command}")


def boot_device_text(r: operator_power.BootDeviceResult) -> str:
    asked = f"{r.device}{' (persistent)' if r.persistent else ''}"
    lines = [f"machine {r.machine}: boot device {asked} set, read back {r.read_back} "
             f"(via {r.bmc}; raw: {r.raw})",
             f"  work {r.work}; history: BootDevice, Finished"]
    if r.persistent and r.read_persistent is not True:
        lines.append(f"  note: asked for every boot, the BMC reports {r.read_back}: only "
                     f"the next boot is sure to be {r.device}")
    elif not r.persistent and r.read_persistent:
        lines.append(f"  note: asked for the next boot, the BMC keeps {r.device} for every "
                     "boot until it is changed")
    return "\n".join(lines)
