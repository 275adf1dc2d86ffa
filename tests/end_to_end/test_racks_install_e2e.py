"""``shepherd up --racks`` installs its simulated machines, end to end, without root.

The simulator's racked machines (SSH servers in sandboxes, behind sushy-emulator) each
have a disk that is a sparse file in a fake system root, and boot at power on what
their BMC's boot override says (``shepherd.simulator.disks``). Real Celery workers and
beat on PostgreSQL and Redis, the callback server serving the simulator's demo image
(``shepherd.simulator.demo_image``) from the image directory: the inventory's ``os``
entry (or an operator's wish) has the agent write the image and the identity, the
workflow boots the disk through the BMC, and the installed system's agent heartbeats.

What the tests check beside Shepherd's own record: the disk file's files (debugfs by
offset), the host key the machine's SSH presents in a real handshake, and what the BMC
itself says of the boot device.
"""

from __future__ import annotations

import json
import socket
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import paramiko
import pytest
import requests

import bmdb
from shepherd.agent import identity
from shepherd.providers import ssh_keys
from shepherd.simulator import demo_image, disks
from shepherd.simulator.racks import Racks
from shepherd.simulator.redfish import available as sushy_available
from shepherd.simulator.server import Simulator
from tests.support.celery_fixtures import ControlPlane, overlapping_work
from tests.support.waiting import wait_until
from tests.support.workers import RACK_DEVICES

pytestmark = [
    pytest.mark.slow,
    RACK_DEVICES,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not sushy_available(), reason="sushy-tools is not installed"),
    pytest.mark.skipif(bool(demo_image.missing_tools()) or identity.find_debugfs() is None,
                       reason="needs sfdisk, mke2fs and debugfs (fdisk, e2fsprogs)"),
]

WORKERS = "shepherd.control,shepherd.machines,shepherd.installations"


class Rack:
    """A control plane over the simulator's racks, the demo image in its catalog."""

    def __init__(self, cp: ControlPlane, racks: Racks, image: demo_image.DemoImage) -> None:
        self.cp, self.racks, self.image = cp, racks, image

    def machine_id(self, name: str) -> uuid.UUID:
        cp = self.cp
        return wait_until(lambda: next((m for m in cp.machine_ids()
                                        if cp.provider_id(m) == name), None),
                          60, f"{name} in the BMDB", cp)

    def settled(self, machine_id: uuid.UUID, generation: int, timeout: float = 240) -> str:
        def outcome() -> str | None:
            wanted = self.cp.db.read(lambda tx: bmdb.installation_of(tx, machine_id)).wanted
            if wanted is None or wanted.generation < generation or wanted.pending:
                return None
            return wanted.outcome
        return wait_until(outcome, timeout, f"installation generation {generation}", self.cp)

    def pin(self, machine_id: uuid.UUID) -> bmdb.RecordedPin | None:
        return self.cp.db.read(lambda tx: bmdb.recorded_host_key(tx, machine_id))

    def disk(self, name: str) -> Path:
        return disks.disk_of(self.cp.simulator.sandbox(name))

    def disk_file(self, name: str, path: str) -> str:
        """A file of the system on the machine's disk, read by offset with debugfs."""
        disk = self.disk(name)
        root = identity.find_root(str(disk))
        done = subprocess.run([identity.find_debugfs() or "debugfs", "-R", f"cat {path}",
                               f"{disk}?offset={root.offset}"],
                              capture_output=True, text=True, timeout=30, check=True)
        assert done.stdout, done.stderr
        return done.stdout

    def presented_key(self, name: str) -> str:
        """The host key the machine's SSH presents, from a real handshake."""
        device = self.cp.simulator.devices[name]
        with socket.create_connection((device.address, self.cp.simulator.ssh_port),
                                      timeout=10) as sock:
            transport = paramiko.Transport(sock)
            try:
                transport.start_client(timeout=10)
                key = transport.get_remote_server_key()
            finally:
                transport.close()
        return f"{key.get_name()} {key.get_base64()}"


@pytest.fixture
def rack(control_plane: Callable[..., ControlPlane], tmp_path: Path) -> Iterator[Rack]:
    """Two racked machines with disks; the inventory asks for the demo image on the
    first. Workers and beat started."""
    images = tmp_path / "images"
    image, note = demo_image.ensure(images)
    assert note is None
    cp = control_plane(
        reservations=2, SHEPHERD_PROVIDER="static",
        SHEPHERD_STATIC_INVENTORY=str(tmp_path / "racks" / "inventory.toml"),
        SHEPHERD_IMAGE_DIR=str(images), SHEPHERD_HEARTBEAT_TIMEOUT="10",
        SHEPHERD_FIRST_HEARTBEAT_TIMEOUT="20", SHEPHERD_RUNG_TIMEOUT="40",
        SHEPHERD_BMC_TIMEOUT="5", SHEPHERD_INSTALL_STALL_TIMEOUT="60",
        SHEPHERD_INSTALL_SSH_DEADLINE="60", SHEPHERD_INSTALL_HEARTBEAT_DEADLINE="30",
        SHEPHERD_INSTALL_BACKOFF="3600,3600,1")
    key = ssh_keys.load_or_create(cp.env["SHEPHERD_SSH_KEY_PATH"])
    racks = Racks(cp.simulator, tmp_path / "racks", 2,
                  authorized_keys=[ssh_keys.public_key_openssh(key)],
                  install=(image.name, 1)).start()
    try:
        cp.start_worker("w1", concurrency=3, queues=WORKERS)
        cp.start_beat()
        yield Rack(cp, racks, image)
    finally:
        racks.stop()


def assert_installed(rack: Rack, name: str, machine_id: uuid.UUID, generation: int) -> str:
    """The machine runs the system generation ``generation`` wrote, presenting the host
    key Shepherd chose and pinned; its agent heartbeats with the marker. Returns the key."""
    sim = rack.cp.simulator
    pin = rack.pin(machine_id)
    assert pin is not None and pin.chosen and pin.generation == generation, pin
    rescue_key = next(m.host_key for m in rack.racks.machines if m.id == name)
    assert pin.host_key != rescue_key
    assert rack.presented_key(name) == pin.host_key
    public = rack.disk_file(name, identity.HOST_KEY + ".pub")
    assert " ".join(public.split()[:2]) == pin.host_key
    marker = json.loads(rack.disk_file(name, identity.MARKER_PATH))
    assert marker == {"machine_id": str(machine_id), "generation": generation,
                      "image": "demo", "sha256": rack.image.sha256,
                      "disk": disks.DISK_SELECTOR}
    assert sim.devices[name].system == disks.DISK
    assert rack.racks.bmc is not None and rack.racks.bmc.boot_target(name) == "Hdd"
    report = wait_until(lambda: (rack.cp.tags(machine_id).get("HardwareReport") or {})
                        .get("report"), 30, "a hardware report", rack.cp)
    assert report["installation"] == marker
    assert rack.cp.tags(machine_id).get("AgentHeartbeat") is not None
    return pin.host_key


def test_racked_machines_install_the_demo_image_and_boot_it(rack: Rack) -> None:
    """rack1-u01 from its inventory entry, rack1-u02 by an operator's wish; then
    rack1-u01 again (a reinstall: its rescue system first), with a new host key."""
    sim = rack.cp.simulator
    first, second = "rack1-u01", "rack1-u02"
    assert [m.os for m in rack.racks.machines] == [("demo", disks.DISK_SELECTOR), None]
    ids = {name: rack.machine_id(name) for name in (first, second)}
    # The blank machines boot their rescue system: the inventory's pin answers.
    for machine in rack.racks.machines:
        assert rack.presented_key(machine.id) == machine.host_key

    wait_until(lambda: rack.cp.tags(ids[second]).get("AgentHeartbeat"), 60,
               f"{second}'s agent heartbeating", rack.cp)
    with rack.cp.db.start_session("operator", interval=30) as session:
        session.transact(lambda tx: bmdb.want_installation(
            tx, ids[second], image="demo", disk=disks.DISK_SELECTOR, origin="operator",
            by="test", reason="demo"))
    assert rack.settled(ids[first], 1) == "installed"
    assert rack.settled(ids[second], 1) == "installed"
    first_key = assert_installed(rack, first, ids[first], 1)
    assert_installed(rack, second, ids[second], 1)

    with rack.cp.db.start_session("operator", interval=30) as session:
        session.transact(lambda tx: bmdb.want_installation(
            tx, ids[first], image="demo", disk=disks.DISK_SELECTOR, origin="operator",
            by="test", reason="reinstall"))
    assert rack.settled(ids[first], 2) == "installed"
    assert assert_installed(rack, first, ids[first], 2) != first_key
    steps = [row["cause"] for row in rack.cp.history()
             if row["machine_id"] == ids[first] and row["event"] == "Step"]
    assert any(str(step).startswith("rescue: ") for step in steps), steps
    assert sim.devices[first].power_changes >= 6  # three cold boots: off, then on
    assert overlapping_work(rack.cp.history()) == []


def test_a_disk_override_on_a_blank_disk_leaves_the_machine_dark(tmp_path: Path) -> None:
    """No control plane: the BMC alone boots a blank disk, and SSH refuses; the network
    boots the rescue system again, its own host key answering."""
    with Simulator(reservations=1, ssh_port=0, workdir=tmp_path / "sim") as sim, \
            Racks(sim, tmp_path / "racks", 1) as racks:
        name = racks.machines[0].id
        device = sim.devices[name]
        assert (device.boot_target, device.system) == ("Pxe", disks.RESCUE)
        cycle(racks, name, "Hdd")
        assert sim.devices[name].system == disks.DARK
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((device.address, sim.ssh_port), timeout=5)
        assert "no GPT" in sim.snapshot()["devices"][0]["boot_problem"]
        cycle(racks, name, "Pxe")
        assert sim.devices[name].system == disks.RESCUE
        sim.wait_for_ssh(name)
        assert sim.presented_host_key_line(name) == racks.machines[0].host_key


def cycle(racks: Racks, name: str, target: str) -> None:
    """Set the boot override, power off and on through the BMC, observed."""
    assert racks.bmc is not None
    url = racks.bmc.base_url + racks.bmc.system_path(name)
    patched = requests.patch(url, auth=racks.bmc.auth, timeout=10,
                             json={"Boot": {"BootSourceOverrideTarget": target}})
    assert patched.status_code in (200, 204), patched.text
    for reset, on in (("ForceOff", False), ("On", True)):
        done = requests.post(url + "/Actions/ComputerSystem.Reset", auth=racks.bmc.auth,
                             json={"ResetType": reset}, timeout=10)
        assert done.status_code in (200, 204), done.text
        wait_until(powered(racks.sim, name, on), 30, f"{name} powered {'on' if on else 'off'}")


def powered(sim: Simulator, name: str, on: bool) -> Callable[[], bool]:
    return lambda: sim.devices[name].powered == on

