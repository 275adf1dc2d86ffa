"""``shepherd power status|on|off|cycle MACHINE``: the machine's power through the
drivers Recovery uses (its BMC from the inventory, else its provider's reboot API).

Unlike ``start``, this runs in the CLI process, not in a worker: an operator at a
console wants the BMC's answer now, and the BMDB claim (``Process.POWER``, in the
agent group) gives the same exclusion a worker would have. The work lives in
``shepherd.operations.power``; this module maps its outcomes to exit statuses: 0 done
and verified, 1 refused (busy) or failed (the BMC, a timeout), 2 a bad argument.
"""

from __future__ import annotations

import dataclasses

import bmdb
from shepherd import operations
from shepherd.cli import render
from shepherd.cli.actions import actor
from shepherd.cli.context import Context, Failed
from shepherd.operations import power as operator_power
from shepherd.runtime import recoverer_settings


def power(ctx: Context) -> int:
    machine_id = operations.parse_machine_id(ctx.args.machine)
    command = ctx.args.command
    runtime = ctx.runtime
    who = actor(ctx)
    try:
        target = operator_power.locate(runtime.session, lambda: runtime.provider,
                                       runtime.power_for, machine_id)
        if command == "status":
            status = operator_power.read_status(target)
            ctx.emit(status, lambda: render.power_status(status))
            return 0
        ladder = recoverer_settings(ctx.settings).ladder
        if ctx.args.wait is not None:
            ladder = dataclasses.replace(ladder, rung_timeout=ctx.args.wait)
        result = operator_power.change(runtime.session, target, command, ladder, who)
    except (operator_power.PowerRefused, bmdb.NotClaimable) as error:
        raise Failed(str(error)) from None
    ctx.emit(result, lambda: render.power_result(result))
    return 0
