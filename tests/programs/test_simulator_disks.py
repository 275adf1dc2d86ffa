"""The simulator's disks and demo image, without root: the image's GPT and catalog
entry, the firmware's boot choice, and a simulated machine booting what its BMC's boot
override says (its rescue system, the system installed on its disk, or nothing).

The disk is written here the way the agent writes it (``installer.install`` against
the device's fake system root, then ``identity``), so the simulator reads back what a
real installation leaves; what the machine presents is checked over real SSH.
"""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import threading
import tomllib
from pathlib import Path
from typing import Any

import paramiko
import pytest

from shepherd.agent import identity, installer
from shepherd.images import Catalog
from shepherd.providers import ssh_keys
from shepherd.simulator import demo_image, disks
from shepherd.simulator.server import Simulator
from shepherd.simulator.ssh import SYS_ROOT_ENV, generate_host_key_text, host_key_from_text
from tests.support.image_server import ImageServer

pytestmark = pytest.mark.skipif(
    bool(demo_image.missing_tools()) or identity.find_debugfs() is None,
    reason="needs sfdisk, mke2fs and debugfs (Debian packages fdisk, e2fsprogs)")


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> demo_image.DemoImage:
    built, note = demo_image.ensure(tmp_path_factory.mktemp("images"))
    assert note is None
    return built


# -- the demo image ---------------------------------------------------------------------


def test_the_demo_image_has_a_root_partition_with_an_ext4_filesystem(image) -> None:
    table = json.loads(subprocess.run(
        [demo_image.find_tool("sfdisk") or "sfdisk", "--json", str(image.path)],
        capture_output=True, text=True, check=True).stdout)["partitiontable"]
    assert table["label"] == "gpt"
    [part] = table["partitions"]
    assert (part["name"], part["type"]) == ("root", demo_image.ROOT_TYPE)
    assert part["start"] * 512 == demo_image.PARTITION_START
    assert image.path.stat().st_size == image.size == demo_image.SIZE
    root = identity.find_root(str(image.path))
    assert root.offset == demo_image.PARTITION_START
    release = subprocess.run([identity.find_debugfs() or "debugfs", "-R", "cat /etc/os-release",
                              f"{image.path}?offset={root.offset}"],
                             capture_output=True, text=True, check=True).stdout
    assert 'NAME="Shepherd demo"' in release
    with pytest.raises(disks.DiskError, match="ssh_host_ed25519_key"):
        disks.read_installed(image.path)  # no host key: the bare image cannot boot


def test_the_catalog_lists_it_with_its_sha256_and_it_is_built_once(image) -> None:
    entry = Catalog.load(image.path.parent).get("demo")
    assert entry.file == image.path.name and entry.format == "raw"
    assert entry.size == image.size
    assert entry.sha256 == hashlib.sha256(image.path.read_bytes()).hexdigest()
    built_at = image.path.stat().st_mtime_ns
    again, note = demo_image.ensure(image.path.parent)
    assert (again, note) == (image, None)
    assert image.path.stat().st_mtime_ns == built_at


def test_an_operators_catalog_keeps_its_entries(image, tmp_path: Path) -> None:
    catalog = tmp_path / "catalog.toml"
    mine = ('# the operator\'s images\n[[images]]\nname = "debian-12"\nurl = '
            '"https://images.example.net/d.raw"\nsha256 = "' + "a" * 64 +
            '"\nsize = 1024\nformat = "raw"\n')
    catalog.write_text(mine)
    assert demo_image.add_to_catalog(catalog, image) is None
    names = [e["name"] for e in tomllib.loads(catalog.read_text())["images"]]
    assert names == ["debian-12", "demo"]
    assert catalog.read_text().startswith("# the operator's images")
    catalog.write_text(mine.replace("debian-12", "demo"))
    note = demo_image.add_to_catalog(catalog, image)
    assert note is not None and "of its own" in note
    assert catalog.read_text() == mine.replace("debian-12", "demo")


# -- the firmware's choice ----------------------------------------------------------------


@pytest.mark.parametrize(("target", "bootable", "booted"), [
    ("Hdd", True, disks.DISK), ("Hdd", False, disks.DARK),
    ("Pxe", True, disks.RESCUE), ("Cd", False, disks.RESCUE),
    ("UefiHttp", True, disks.RESCUE), (None, True, disks.DISK),
    (None, False, disks.RESCUE), ("None", True, disks.DISK),
    ("BiosSetup", True, disks.DARK)])
def test_the_firmware_boots_what_the_override_says(target, bootable, booted) -> None:
    assert disks.boot_choice(target, bootable) == booted


# -- a machine booting its disk ---------------------------------------------------------


class Machine:
    """One simulated device with a disk; root logs in with the private key file ``key``."""

    def __init__(self, sim: Simulator, key: Path) -> None:
        self.sim, self.key = sim, key
        reservation = sim.state.project_reservations()[0]
        device = sim.create_device({
            "metro": reservation.metro, "plan": reservation.plan,
            "operating_system": "ubuntu_22_04", "hardware_reservation_id": reservation.id},
            device_id="m1", provision_delay=0.0)
        self.name = device.id
        self.disk = sim.attach_disk(self.name, 32 << 20)
        self.root = disks.root_of(sim.sandbox(self.name))
        # Its SSH comes up on its own thread: a test on a loaded host could be first.
        sim.wait_for_state(self.name, "active", timeout=10)
        sim.wait_for_ssh(self.name, timeout=10)

    def power_cycle(self, target: str | None) -> None:
        if target is not None:
            self.sim.set_boot_target(self.name, target)
        self.sim.set_power(self.name, False)
        self.sim.set_power(self.name, True)

    def ssh(self, command: str) -> tuple[str, str]:
        """(the host key presented, the command's output) over a real connection."""
        device = self.sim.devices[self.name]
        client = paramiko.SSHClient()
        client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
        client.connect(device.address, port=self.sim.ssh_port, username="root",
                       key_filename=str(self.key), look_for_keys=False, allow_agent=False,
                       timeout=10)
        try:
            transport = client.get_transport()
            assert transport is not None
            presented = transport.get_remote_server_key()
            _, stdout, _ = client.exec_command(command, timeout=10)
            return f"{presented.get_name()} {presented.get_base64()}", stdout.read().decode()
        finally:
            client.close()


@pytest.fixture
def machine(tmp_path: Path) -> Any:
    key = ssh_keys.load_or_create(tmp_path / "fleet")
    with Simulator(reservations=1, ssh_port=0, workdir=tmp_path / "sim",
                   per_device_host_keys=True) as sim:
        sim.state.create_ssh_key({"label": "fleet", "key": ssh_keys.public_key_openssh(key)})
        yield Machine(sim, tmp_path / "fleet")


def install(machine: Machine, image: demo_image.DemoImage, host_key: str,
            authorized: list[str]) -> dict[str, Any]:
    """What the agent does on the machine: the image on ``device=/dev/sda`` of its fake
    root, then the identity."""
    public = host_key_from_text(host_key)
    request: dict[str, Any] = {
        "kind": "image", "disk": disks.DISK_SELECTOR,
        "image": {"name": "demo", "url": "", "sha256": image.sha256, "size": image.size,
                  "format": "raw"},
        "identity": {"hostname": "installed-m1", "authorized_keys": authorized,
                     "host_key": {"public": f"ssh-ed25519 {public.get_base64()}",
                                  "private_openssh": host_key},
                     "marker": {"generation": 1, "image": "demo", "sha256": image.sha256,
                                "machine_id": "6f1c2d4e-0000-4000-8000-000000000001"}}}
    server = ImageServer(image.path)
    try:
        request["image"]["url"] = server.url
        return installer.install(request, progress=lambda _: None,
                                 cancelled=threading.Event(), sys_root=str(machine.root))
    finally:
        server.stop()


def test_a_machine_boots_its_rescue_system_its_installed_disk_or_nothing(
        machine: Machine, image: demo_image.DemoImage) -> None:
    sim, name = machine.sim, machine.name
    rescue = sim.host_key_line(name)
    presented, said = machine.ssh(f"echo ${SYS_ROOT_ENV}")
    assert (presented, said.strip()) == (rescue, str(machine.root))
    assert sim.devices[name].system == disks.RESCUE

    machine.power_cycle("Hdd")  # a blank disk: nothing boots
    assert sim.devices[name].system == disks.DARK
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((sim.devices[name].address, sim.ssh_port), timeout=5)
    machine.power_cycle("Pxe")

    chosen = generate_host_key_text()
    other_path = machine.key.with_name("other")
    other = ssh_keys.load_or_create(other_path)
    result = install(machine, image, chosen, [ssh_keys.public_key_openssh(other)])
    assert result["status"] == "ok", result
    assert result["disk"] == "/dev/sda" and result["identity"]["read_back"] is True
    machine.power_cycle("Hdd")
    assert sim.devices[name].system == disks.DISK
    wanted = host_key_from_text(chosen)
    assert sim.presented_host_key_line(name) == f"ssh-ed25519 {wanted.get_base64()}"
    assert sim.host_key_line(name) == rescue  # the inventory's pin is the rescue's
    marker = json.loads((machine.root / identity.MARKER_PATH.lstrip("/")).read_text())
    assert marker["generation"] == 1 and marker["image"] == "demo"
    assert (machine.root / disks.HOSTNAME).read_text() == "installed-m1\n"
    # The installed system's authorized_keys, not the project's: the fleet key is refused.
    with pytest.raises(paramiko.AuthenticationException):
        machine.ssh("true")
    fleet, machine.key = machine.key, other_path
    presented, _ = machine.ssh("true")
    assert presented == f"ssh-ed25519 {wanted.get_base64()}"

    machine.key = fleet
    machine.power_cycle("Pxe")  # the rescue system again: its key, no marker
    presented, _ = machine.ssh("true")
    assert presented == rescue and sim.devices[name].system == disks.RESCUE
    assert not (machine.root / identity.MARKER_PATH.lstrip("/")).exists()
    assert (machine.root / disks.HOSTNAME).is_symlink()


def test_a_restarted_simulator_boots_the_disk_it_ran(tmp_path: Path,
                                                     image: demo_image.DemoImage) -> None:
    settings: dict[str, Any] = {"reservations": 1, "ssh_port": 0, "workdir": tmp_path / "sim",
                                "per_device_host_keys": True, "persist": True,
                                "project_id": "00000000-0000-4000-8000-00000000000a"}
    chosen = generate_host_key_text()
    fleet = ssh_keys.public_key_openssh(ssh_keys.load_or_create(tmp_path / "fleet"))
    (tmp_path / "sim").mkdir()
    with Simulator(**settings) as sim:
        machine = Machine(sim, tmp_path / "fleet")
        assert install(machine, image, chosen, [fleet])["status"] == "ok"
        machine.power_cycle("Hdd")
        presented = sim.presented_host_key_line(machine.name)
        port = sim.ssh_port
    with Simulator(**{**settings, "ssh_port": port}) as again:
        device = again.devices["m1"]
        assert (device.system, device.boot_target) == (disks.DISK, "Hdd")
        assert again.presented_host_key_line("m1") == presented
        assert again.host_key_line("m1") != presented
        assert again.endpoint("m1").sys_root == disks.root_of(again.sandbox("m1"))


def test_an_attached_disk_is_kept_as_it_is(tmp_path: Path) -> None:
    sandbox = tmp_path / "sandbox"
    root = disks.attach(sandbox, 4 << 20)
    disk = disks.disk_of(sandbox)
    assert disk.stat().st_size == 4 << 20 and disk.stat().st_blocks == 0  # sparse
    assert (root / "sys/block/sda/size").read_text() == f"{(4 << 20) // 512}\n"
    assert (root / "proc/mounts").read_text() == ""
    disk.write_bytes(b"x" * (8 << 20))
    disks.attach(sandbox, 4 << 20)
    assert disk.stat().st_size == 8 << 20
    assert (root / "sys/block/sda/size").read_text() == f"{(8 << 20) // 512}\n"
