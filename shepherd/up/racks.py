"""``shepherd up --racks``: the simulator's machines run as real racks would.

Instead of the simulated provider API, the control plane reads a static inventory
(``SHEPHERD_PROVIDER=static``), as it does for machines of one's own: the simulator
racks its machines (``shepherd simulator --racks``, see ``shepherd.simulator.racks``)
behind one emulated Redfish BMC (sushy-emulator, Basic auth) and writes the
inventory, with each machine's host key pinned and its BMC's password in a 0600
file beside it. Recovery then climbs its ladder against a BMC no one here wrote: hang
a machine (``/_admin/devices/ID/hang``; SSH refuses until a power cycle) and watch
it being power-cycled back.

This module prepares the racks directory (the fleet key's public half for root
logins, the simulator's token for the admin calls, both files 0600), builds the
simulator's command line and says what runs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from shepherd.files import write_private
from shepherd.inventory.file import load_inventory
from shepherd.providers import ssh_keys
from shepherd.up.environment import Plan

AUTHORIZED_KEYS = "authorized_keys"
TOKEN_FILE = "simulator-token"


def prepare(plan: Plan, out: Callable[[str], None]) -> None:
    """The racks directory, resumed like the rest of the state (the simulator keeps
    its machines), without the last run's inventory: ``up`` waits for the simulator
    to write this run's, which it does once its machines and BMC answer."""
    assert plan.racks is not None and plan.inventory is not None
    plan.racks.mkdir(parents=True, exist_ok=True)
    plan.inventory.unlink(missing_ok=True)
    key = ssh_keys.load_or_create(plan.env["SHEPHERD_SSH_KEY_PATH"])
    write_private(plan.racks / AUTHORIZED_KEYS, ssh_keys.public_key_openssh(key) + "\n")
    write_private(plan.racks / TOKEN_FILE, plan.env["SHEPHERD_SIMULATOR_TOKEN"] + "\n")
    out(f"racks: the simulator lists its machines in {plan.inventory}")


def simulator_argv(plan: Plan, machines: int) -> list[str]:
    """``shepherd simulator --racks``: ``machines`` machines, root logins by the fleet key."""
    assert plan.racks is not None and plan.simulator_port and plan.ssh_port
    return [sys.executable, "-m", "shepherd.cli", "simulator",
            "--reservations", str(machines), "--http-port", str(plan.simulator_port),
            "--ssh-port", str(plan.ssh_port), "--workdir", str(plan.workdir / "simulator"),
            "--persist",
            "--racks", str(plan.racks), "--authorized-keys", str(plan.racks / AUTHORIZED_KEYS)]


def announce(plan: Plan, out: Callable[[str], None]) -> None:
    """What runs, and how to see the ladder work (a hung machine needs its BMC)."""
    assert plan.racks is not None and plan.inventory is not None
    machines = load_inventory(plan.inventory)
    bmcs = sorted({m.bmc.address for m in machines if m.bmc is not None})
    first = machines[0].provider_id
    admin = f"http://127.0.0.1:{plan.simulator_port}/metal/v1/_admin/devices"
    out(f"racks:     {len(machines)} machines listed in {plan.inventory}")
    out(f"           behind emulated Redfish BMCs at {', '.join(bmcs)} (user and "
        f"password file in the inventory); probe them: shepherd inventory check "
        f"{plan.inventory} --probe")
    out(f"try:       hang {first} (SSH refuses until its BMC power-cycles it):")
    out(f"           curl -X POST -H \"X-Auth-Token: $(cat {plan.racks / TOKEN_FILE})\" "
        f"{admin}/{first}/hang")
