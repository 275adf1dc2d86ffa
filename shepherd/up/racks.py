"""``shepherd up --racks``: the simulator's machines run as real racks would.

Instead of the simulated provider API, the control plane reads a static inventory
(``SHEPHERD_PROVIDER=static``), as it does for machines of one's own: the simulator
racks its machines (``shepherd simulator --racks``, see ``shepherd.simulator.racks``)
behind one emulated Redfish BMC (sushy-emulator, Basic auth) and writes the
inventory, with each machine's host key pinned and its BMC's password in a 0600
file beside it. Recovery then climbs its ladder against a BMC no one here wrote: hang
a machine (``/_admin/devices/ID/hang``; SSH refuses until a power cycle) and watch
it being power-cycled back.

Each machine has a disk and boots what its BMC's boot override says (the rescue
system until something is installed: ``shepherd.simulator.disks``). ``prepare`` builds
the simulator's demo image once into the image directory (cached by its recipe's hash)
with a ``demo`` entry in its ``catalog.toml`` (``shepherd.simulator.demo_image``), so
``shepherd serve`` serves it and ``shepherd install MACHINE demo --disk device=/dev/sda``
installs it; ``--install N`` has the inventory ask for it on the first N machines.

This module prepares the racks directory (the fleet key's public half for root
logins, the simulator's token for the admin calls, both files 0600), builds the
simulator's command line and says what runs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from shepherd.agent.identity import find_debugfs
from shepherd.files import write_private
from shepherd.inventory.file import load_inventory
from shepherd.providers import ssh_keys
from shepherd.simulator import demo_image
from shepherd.simulator.disks import DISK_SELECTOR
from shepherd.up.environment import Plan, UpError

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
    prepare_demo_image(plan, out)


def prepare_demo_image(plan: Plan, out: Callable[[str], None]) -> bool:
    """The demo image and its catalog entry in the image directory; whether machines
    can be installed. Without the tools that is said in one line (racks run all the
    same), unless ``--install`` asked for installations: then ``UpError``."""
    try:
        if find_debugfs() is None:
            raise demo_image.DemoImageError("installing needs debugfs (Debian package "
                                            "e2fsprogs): not found on PATH or in sbin")
        image, note = demo_image.ensure(plan.image_dir)
    except (demo_image.DemoImageError, OSError) as error:
        if plan.install:
            raise UpError(f"--install: {error}") from None
        out(f"racks: machines cannot be installed here: {error}")
        return False
    out(f"racks: demo image {image.path.name} listed as {image.name!r} in "
        f"{plan.image_dir / 'catalog.toml'}")
    if note:
        out(f"racks: {note}")
    return True


def simulator_argv(plan: Plan, machines: int) -> list[str]:
    """``shepherd simulator --racks``: ``machines`` machines, root logins by the fleet key."""
    assert plan.racks is not None and plan.simulator_port and plan.ssh_port
    return [sys.executable, "-m", "shepherd.cli", "simulator",
            "--reservations", str(machines), "--http-port", str(plan.simulator_port),
            "--ssh-port", str(plan.ssh_port), "--workdir", str(plan.workdir / "simulator"),
            "--persist",
            "--racks", str(plan.racks), "--authorized-keys", str(plan.racks / AUTHORIZED_KEYS),
            *(["--install", demo_image.NAME, "--install-machines", str(plan.install)]
              if plan.install else [])]


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
    asked = [m.provider_id for m in machines if m.os is not None]
    if asked:
        out(f"install:   the inventory asks for the demo image on {', '.join(asked)}: "
            f"follow it in the web view or with `shepherd show MACHINE`")
    out(f"install:   the demo image on {first}'s disk (MACHINE is its BMDB id, which "
        f"`shepherd machines` lists):")
    out(f"           shepherd install \"$(shepherd machines | awk '$3 == \"{first}\" "
        f"{{print $1}}')\" {demo_image.NAME} --disk {DISK_SELECTOR} --reason \"demo\"")
