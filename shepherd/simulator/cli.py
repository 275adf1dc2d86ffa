"""``shepherd simulator``: run the simulated provider in the foreground until SIGINT/SIGTERM.

With ``--racks DIR`` its machines are racked instead (``shepherd.simulator.racks``):
devices made at once, behind an emulated Redfish BMC, listed in ``DIR/inventory.toml``,
each with a disk of ``--disk-mib`` MiB; ``--install IMAGE`` puts an ``os`` entry for that
image on the first ``--install-machines`` machines (the control plane installs it).

With ``--persist`` the world is kept in ``WORKDIR/world.json`` and a restart resumes
it (``shepherd.simulator.persist``): a stored world wins over ``--reservations``;
one of another project, or a corrupt one, is refused (exit 2) and left as it is.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from shepherd.simulator.disks import DEFAULT_DISK_SIZE
from shepherd.simulator.persist import WorldError
from shepherd.simulator.racks import Racks
from shepherd.simulator.redfish import EmulatorError
from shepherd.simulator.server import Simulator, SimulatorConfig

TOKEN_ENV = "SHEPHERD_SIMULATOR_TOKEN"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shepherd simulator",
        description="A simulated Equinix Metal project whose devices are SSH servers on "
                    "loopback addresses.",
    )
    parser.add_argument("--reservations", type=int, default=10,
                        help="hardware reservations to hold (default 10)")
    parser.add_argument("--http-port", type=int, default=8780,
                        help="API port on 127.0.0.1 (0: any free port; default 8780)")
    parser.add_argument("--api-host", default="127.0.0.1",
                        help="address the API listens on (default 127.0.0.1; 0.0.0.0 in a "
                             "container so other containers reach it)")
    parser.add_argument("--ssh-port", type=int, default=2222,
                        help="SSH port of every device (0: one free port; default 2222)")
    parser.add_argument("--address-net", type=int, default=100,
                        help="devices get 127.<net>.x.y (default 100)")
    parser.add_argument("--project-id", default="00000000-0000-4000-8000-000000000001",
                        help="the simulated project's id")
    parser.add_argument("--token", default=None,
                        help=f"API token (prefer the {TOKEN_ENV} environment variable)")
    parser.add_argument("--provision-delay", type=float, default=5.0,
                        help="seconds from queued to active (default 5)")
    parser.add_argument("--reboot-delay", type=float, default=5.0,
                        help="seconds SSH stays down after a reboot (default 5)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where device sandboxes live (default: a temporary directory)")
    parser.add_argument("--seed", type=int, default=None, help="seed for fault dice")
    parser.add_argument("--per-device-host-keys", action="store_true",
                        help="one SSH host key per device (default: one shared key)")
    parser.add_argument("--racks", type=Path, default=None, metavar="DIR",
                        help="rack the machines: one device per reservation at once, behind "
                             "an emulated Redfish BMC, listed in DIR/inventory.toml")
    parser.add_argument("--authorized-keys", type=Path, default=None, metavar="FILE",
                        help="with --racks: OpenSSH public keys (one a line) root logins "
                             "accept, e.g. the shepherd's fleet key")
    parser.add_argument("--disk-mib", type=int, default=DEFAULT_DISK_SIZE >> 20,
                        metavar="MIB", help="with --racks: each machine's disk, in MiB "
                        f"(default {DEFAULT_DISK_SIZE >> 20}; a new machine's only)")
    parser.add_argument("--install", default=None, metavar="IMAGE",
                        help="with --racks: the inventory asks for this catalog image on "
                             "the disk (device=/dev/sda) of the first --install-machines")
    parser.add_argument("--install-machines", type=int, default=1, metavar="N",
                        help="with --install: how many machines (default 1)")
    parser.add_argument("--persist", action="store_true",
                        help="keep the world (reservations, devices, keys, host keys, "
                             "power) in WORKDIR/world.json and resume it at start; needs "
                             "--workdir")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="debug logging, the devices' SSH transport included")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.persist and args.workdir is None:
        parser.error("--persist needs --workdir (the world is kept in WORKDIR/world.json)")
    token = args.token or os.environ.get(TOKEN_ENV)
    if not token:
        print(f"shepherd simulator: set {TOKEN_ENV} (or --token)", file=sys.stderr)
        return 2
    if not 0 <= args.address_net <= 255 or args.reservations < 0:
        print("shepherd simulator: bad --address-net or --reservations", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.verbose:
        logging.getLogger("shepherd.simulator.ssh.transport").setLevel(logging.DEBUG)
    config = SimulatorConfig(
        reservations=args.reservations, project_id=args.project_id, token=token,
        http_port=args.http_port, api_host=args.api_host, ssh_port=args.ssh_port,
        address_net=args.address_net,
        provision_delay=args.provision_delay, reboot_delay=args.reboot_delay,
        workdir=args.workdir, seed=args.seed,
        per_device_host_keys=args.per_device_host_keys or args.racks is not None,
        persist=args.persist,
    )
    try:
        keys = _authorized_keys(args.authorized_keys)
    except OSError as error:
        print(f"shepherd simulator: --authorized-keys: {error.strerror}", file=sys.stderr)
        return 2
    done = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: done.set())
    try:
        sim = Simulator(config)
    except WorldError as error:
        print(f"shepherd simulator: {error}", file=sys.stderr)
        return 2
    try:
        sim.start()
    except OSError as error:
        sim.stop()
        print(f"shepherd simulator: cannot listen: {error}", file=sys.stderr)
        return 1
    racks: Racks | None = None
    try:
        # A loaded world may hold other than --reservations: what it holds counts.
        reservations = len(sim.state.project_reservations())
        info: dict[str, object] = {
            "base_url": sim.base_url, "project_id": sim.project_id,
            "ssh_port": sim.ssh_port, "reservations": reservations,
            "world": str(sim.world_file) if sim.world_file else None,
            "loaded": sim.loaded is not None}
        if args.racks is not None:
            try:
                install = ((args.install, min(args.install_machines, reservations))
                           if args.install else None)
                racks = Racks(sim, args.racks, reservations, authorized_keys=keys,
                              disk_size=args.disk_mib << 20, install=install).start()
            except (EmulatorError, ValueError, OSError) as error:
                print(f"shepherd simulator: cannot rack the machines: {error}",
                      file=sys.stderr)
                return 1
            assert racks.bmc is not None
            info.update({"inventory": str(racks.inventory_path), "bmc": racks.bmc.base_url})
        print(json.dumps(info), flush=True)
        while not done.wait(0.5):
            pass
    finally:
        if racks is not None:
            racks.stop()
        sim.stop()
    return 0


def _authorized_keys(path: Path | None) -> list[str]:
    if path is None:
        return []
    return [line.strip() for line in path.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


if __name__ == "__main__":
    sys.exit(main())
