"""Installing an operating system end to end, from a blank disk to our agent heartbeating
on the installed system, on real parts: real Celery workers and beat on PostgreSQL and
Redis, a static inventory, BMCs no one here wrote (sushy-emulator, OpenIPMI's
``ipmi_sim``) and machines that boot what their BMC says (``tests.support.
bootable_machines``): a rescue system by network, or the system on their loop disk.

Each machine starts powered on with a blank disk, so it boots the rescue system (a
stock Debian) whose host key the inventory pins; AgentStart takes it over, the
inventory's ``os`` entry makes the wish, and the installation takes it from there.
What the tests check independently of Shepherd: the disk's files (read by offset with
debugfs), what the BMC itself says of its boot device (a plain Redfish GET, ipmitool),
and which system the machine booted.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import sqlalchemy as sa

import bmdb
from shepherd.images import Image
from shepherd.inventory.host_keys import key_line_fingerprint
from shepherd.providers import ssh_keys
from shepherd.simulator.redfish import available as sushy_available
from tests.support.bmc_fixtures import IpmiBmc, RedfishBmc, running_redfish
from tests.support.bootable_machines import (
    BootableMachine,
    IpmiLink,
    Link,
    RedfishLink,
    bootable_machine,
    personalize,
    read_disk_file,
    require_bootable_machines,
)
from tests.support.celery_fixtures import ControlPlane
from tests.support.disk_images import MIB, OsImage, os_image
from tests.support.waiting import wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.stock_machines,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not sushy_available(), reason="sushy-tools is not installed"),
]

DISK_SIZE = 384 * MIB
OS_INSTALL = bmdb.Process.OS_INSTALL.value
WORKERS = "shepherd.control,shepherd.machines,shepherd.installations"


@pytest.fixture(autouse=True)
def _requirements() -> None:
    require_bootable_machines()


@pytest.fixture
def image() -> OsImage:
    return os_image("bookworm")


@dataclass
class Racked:
    """One machine of the test's rack: its inventory entry's parts and its BMC's link."""

    name: str
    machine: BootableMachine
    bmc_line: str
    #: The BMC itself (``RedfishBmc`` or ``IpmiBmc``), to ask it what it says.
    bmc: Any = None
    link: Link | None = None

    @property
    def disk(self) -> str:
        return self.machine.disk


class Rack:
    """A control plane whose provider is a static inventory of bootable machines."""

    def __init__(self, make_plane: Callable[..., ControlPlane], tmp_path: Path,
                 image: OsImage, stack: contextlib.ExitStack) -> None:
        self.tmp_path, self.image, self.stack = tmp_path, image, stack
        self.images = tmp_path / "images"
        self.images.mkdir()
        self.inventory = tmp_path / "inventory.toml"
        self.catalog({"bookworm": image})
        self.make_plane = make_plane
        self.cp: ControlPlane | None = None
        self.machines: dict[str, Racked] = {}

    def catalog(self, images: dict[str, OsImage]) -> None:
        entries = []
        for name, image in images.items():
            linked = self.images / f"{name}.raw"
            if not linked.exists():
                link_or_copy(image.raw, linked)
            entries.append(Image(name, image.sha256, image.size, "raw", file=linked.name)
                           .catalog_entry())
        (self.images / "catalog.toml").write_text("\n".join(entries))

    def plane(self, **env: str) -> ControlPlane:
        settings = {
            "SHEPHERD_PROVIDER": "static", "SHEPHERD_STATIC_INVENTORY": str(self.inventory),
            "SHEPHERD_IMAGE_DIR": str(self.images), "SHEPHERD_HEARTBEAT_TIMEOUT": "10",
            "SHEPHERD_FIRST_HEARTBEAT_TIMEOUT": "20", "SHEPHERD_RUNG_TIMEOUT": "40",
            "SHEPHERD_BMC_TIMEOUT": "5", "SHEPHERD_INSTALL_STALL_TIMEOUT": "60",
            "SHEPHERD_INSTALL_SSH_DEADLINE": "60", "SHEPHERD_INSTALL_HEARTBEAT_DEADLINE": "30",
            # One attempt per test: a failure's cause is what the test reads.
            "SHEPHERD_INSTALL_BACKOFF": "3600,3600,1"}
        self.cp = self.make_plane(reservations=1, **{**settings, **env})
        return self.cp

    def public_key(self) -> str:
        assert self.cp is not None
        key = ssh_keys.load_or_create(self.cp.env["SHEPHERD_SSH_KEY_PATH"])
        return ssh_keys.public_key_openssh(key)

    def machine(self, name: str) -> BootableMachine:
        return self.stack.enter_context(bootable_machine(self.tmp_path / name,
                                                         self.public_key(),
                                                         disk_size=DISK_SIZE))

    def redfish(self, name: str, **options: Any) -> Racked:
        """A machine behind its own sushy-emulator system, powered on."""
        bmc: RedfishBmc = self.stack.enter_context(
            running_redfish(self.tmp_path / f"{name}-bmc", ((name, "On"),),
                            **options.pop("emulator", {})))
        spec = bmc.spec(name)
        # A rack set up to boot by network until something is installed (the emulator's
        # fake system reports Hdd when no override was ever set).
        patched = requests.patch(bmc.address + bmc.emulator.system_path(name),
                                 auth=bmc.emulator.auth, timeout=10,
                                 json={"Boot": {"BootSourceOverrideTarget": "Pxe",
                                                "BootSourceOverrideEnabled": "Continuous"}})
        assert patched.status_code in (200, 204), patched.text
        line = (f'{{ driver = "redfish", address = "{spec.address}", username = '
                f'"{spec.username}", password_file = "{spec.password_file}", '
                f'system = "{spec.system}" }}')
        racked = Racked(name, self.machine(name), line, bmc)
        racked.link = self.stack.enter_context(RedfishLink(bmc.emulator, name, racked.machine,
                                                           **options))
        self.machines[name] = racked
        return racked

    def ipmi(self, name: str, **options: Any) -> Racked:
        """A machine behind its own ipmi_sim, powered on."""
        bmc = IpmiBmc(self.tmp_path / f"{name}-bmc", power_on=True).start()
        self.stack.callback(bmc.stop)
        spec = bmc.spec()
        line = (f'{{ driver = "ipmi", address = "{spec.address}", port = {spec.port}, '
                f'username = "{spec.username}", password_file = "{spec.password_file}" }}')
        racked = Racked(name, self.machine(name), line, bmc)
        racked.link = self.stack.enter_context(IpmiLink(bmc, racked.machine, **options))
        self.machines[name] = racked
        return racked

    def write_inventory(self, images: dict[str, str]) -> None:
        """Every machine, ``images[name]`` its os entry's image; written in one rename."""
        lines = []
        for name, racked in self.machines.items():
            machine = racked.machine
            lines += ["[[machines]]", f'id = "{name}"', f'address = "{machine.address}"',
                      f"ssh_port = {machine.port}", f'host_key = "{machine.rescue_host_key}"',
                      f"bmc = {racked.bmc_line}"]
            if name in images:
                lines.append(f'os = {{ image = "{images[name]}", disk = "device={racked.disk}" }}')
            lines.append("")
        staged = self.inventory.with_suffix(".staged")
        staged.write_text("\n".join(lines))
        staged.replace(self.inventory)

    def start(self) -> ControlPlane:
        assert self.cp is not None
        self.cp.start_worker("w1", concurrency=3, queues=WORKERS)
        self.cp.start_beat()
        return self.cp

    def machine_id(self, name: str) -> uuid.UUID:
        assert self.cp is not None
        cp = self.cp
        return wait_until(lambda: next((m for m in cp.machine_ids()
                                        if cp.provider_id(m) == name), None),
                          60, f"{name} in the BMDB", cp)

    def installation(self, machine_id: uuid.UUID) -> bmdb.Installation:
        assert self.cp is not None
        return self.cp.db.read(lambda tx: bmdb.installation_of(tx, machine_id))

    def settled(self, machine_id: uuid.UUID, generation: int, timeout: float = 300) -> str:
        """The outcome of the wish once generation ``generation`` settled it."""
        def outcome() -> str | None:
            wanted = self.installation(machine_id).wanted
            if wanted is None or wanted.generation < generation or wanted.pending:
                return None
            return wanted.outcome
        return wait_until(outcome, timeout, lambda: self.stuck(machine_id, generation),
                          self.cp)

    def stuck(self, machine_id: uuid.UUID, generation: int) -> str:
        """What a wait for an installation that never settled prints: the machine's
        history, the other installations in flight (the cap) and the workers' errors."""
        assert self.cp is not None
        cp = self.cp
        history = [f"{row['process']} {row['event']} {row['cause'] or ''}".strip()
                   for row in self.history(machine_id)]
        work = bmdb._schema.work
        in_flight = [f"{row.machine_id} {row.process}" for row in cp.db.read(
            lambda tx: tx.execute(sa.select(work.c.machine_id, work.c.process)).all())]
        return (f"installation generation {generation} of {machine_id}; its history: "
                f"{history}; work in flight: {in_flight}; worker errors: "
                f"{cp.log_problems('w1', 'beat')[-20:]}")

    def failure(self, machine_id: uuid.UUID, timeout: float = 300) -> str:
        """The cause of the machine's first failed installation."""
        def failed() -> str | None:
            rows = [row for row in self.history(machine_id)
                    if row["process"] == OS_INSTALL and row["event"] == "Failed"]
            return rows[0]["cause"] if rows else None
        return wait_until(failed, timeout, "a failed installation", self.cp)

    def history(self, machine_id: uuid.UUID) -> list[dict[str, Any]]:
        assert self.cp is not None
        return [row for row in self.cp.history() if row["machine_id"] == machine_id]

    def steps(self, machine_id: uuid.UUID) -> list[str]:
        return [f"{row['event']} {row['cause']}" if row["event"] == "Step" else row["event"]
                for row in self.history(machine_id) if row["process"] == OS_INSTALL]

    def pin(self, machine_id: uuid.UUID) -> bmdb.RecordedPin | None:
        assert self.cp is not None
        return self.cp.db.read(lambda tx: bmdb.recorded_host_key(tx, machine_id))


def link_or_copy(source: Path, target: Path) -> None:
    """A hard link where the image cache is on the same filesystem (no copy of 320 MiB)."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


@pytest.fixture
def rack(control_plane: Callable[..., ControlPlane], tmp_path: Path, image: OsImage
         ) -> Iterator[Rack]:
    with contextlib.ExitStack() as stack:
        yield Rack(control_plane, tmp_path, image, stack)


def disk_host_key(racked: Racked) -> str:
    return " ".join(read_disk_file(racked.disk, "/etc/ssh/ssh_host_ed25519_key.pub").split()[:2])


def disk_marker(racked: Racked) -> dict[str, Any]:
    return dict(json.loads(read_disk_file(racked.disk, "/etc/shepherd/installation.json")))


def assert_installed(rack: Rack, racked: Racked, machine_id: uuid.UUID, generation: int,
                     image: OsImage) -> str:
    """The machine runs the system generation ``generation`` wrote, with the key Shepherd
    chose and pinned before it first booted; its agent heartbeats from there. Returns
    that key."""
    pin = rack.pin(machine_id)
    assert pin is not None and pin.chosen and pin.generation == generation, pin
    assert disk_host_key(racked) == pin.host_key  # the disk's own file, read by the test
    assert disk_marker(racked) == {"machine_id": str(machine_id), "generation": generation,
                                   "image": "bookworm", "sha256": image.sha256,
                                   "disk": f"device={racked.disk}"}
    assert read_disk_file(racked.disk, "/etc/hostname").strip() == racked.name
    assert rack.public_key().split()[1] in read_disk_file(racked.disk,
                                                          "/root/.ssh/authorized_keys")
    # Generated for this machine: not the image builder's key, not the rescue system's.
    assert pin.host_key != racked.machine.rescue_host_key
    assert racked.machine.booted == "disk", racked.machine.boots
    assert rack.cp is not None
    report = rack.cp.tags(machine_id)["HardwareReport"]["report"]
    assert report["installation"]["generation"] == generation
    assert rack.cp.tags(machine_id).get("AgentHeartbeat") is not None
    return pin.host_key


def test_a_blank_machine_behind_redfish_is_installed_then_reinstalled(rack: Rack,
                                                                     image: OsImage) -> None:
    rack.plane()
    racked = rack.redfish("m1")
    rack.write_inventory({"m1": "bookworm"})
    rack.start()
    machine_id = rack.machine_id("m1")
    assert rack.settled(machine_id, 1) == "installed"
    first_key = assert_installed(rack, racked, machine_id, 1, image)
    assert racked.bmc.boot_target("m1") == "Hdd"  # a plain Redfish GET
    steps = rack.steps(machine_id)
    # The BMC identity is checked before the first change through it (BmcIdentity).
    assert steps == ["Wanted", "Started", "Dispatched", "Verified",
                     "Step generation 1: boot_device", "BmcIdentity",
                     "Step generation 1: rebooting", "Rung",
                     "Step generation 1: taking_over", "Step generation 1: first_heartbeat",
                     "Finished"], steps

    # Reinstallation: the running system lives on the disk to write, so the rescue
    # system is booted first; a new generation, a new key.
    assert rack.cp is not None
    with rack.cp.db.start_session("operator", interval=30) as session:
        session.transact(lambda tx: bmdb.want_installation(
            tx, machine_id, image="bookworm", disk=f"device={racked.disk}",
            origin="operator", by="test", reason="reinstall"))
    assert rack.settled(machine_id, 2) == "installed"
    second_key = assert_installed(rack, racked, machine_id, 2, image)
    assert second_key != first_key
    assert racked.machine.boots == ["rescue", "disk", "rescue", "disk"]
    assert any(s.startswith("Step rescue: ") for s in rack.steps(machine_id))


def test_a_blank_machine_behind_ipmi_is_installed_and_a_changed_key_is_refused(
        rack: Rack, image: OsImage) -> None:
    rack.plane()
    racked = rack.ipmi("m2")
    rack.write_inventory({"m2": "bookworm"})
    rack.start()
    machine_id = rack.machine_id("m2")
    assert rack.settled(machine_id, 1) == "installed"
    pinned = assert_installed(rack, racked, machine_id, 1, image)
    bmc: IpmiBmc = racked.bmc
    said = bmc.ipmitool("chassis", "bootparam", "get", "5")
    assert "Force Boot from default Hard-Drive" in said.stdout, said.stdout

    # Behind Shepherd's back: the installed system gets another host key.
    assert bmc.ipmitool("chassis", "power", "off").returncode == 0
    wait_until(lambda: racked.machine.booted is None, 30, "the machine halted")
    other = personalize(racked.disk, rack.tmp_path / "behind-the-back", rack.public_key())
    assert bmc.ipmitool("chassis", "power", "on").returncode == 0

    def refused() -> str | None:
        causes = [str(row["cause"]) for row in rack.history(machine_id)]
        return next((c for c in causes if key_line_fingerprint(other) in c), None)

    cause = wait_until(refused, 120, "a takeover refused on the changed key", rack.cp)
    assert "host key mismatch" in cause and key_line_fingerprint(pinned) in cause, cause
    pin = rack.pin(machine_id)
    assert pin is not None and pin.host_key == pinned  # nothing trusted on sight


def test_a_bmc_that_does_not_keep_the_boot_device_fails_the_installation(
        rack: Rack) -> None:
    rack.plane(SHEPHERD_INSTALL_QUARANTINE_AFTER="1")
    racked = rack.redfish("m3")
    racked.bmc.emulator.set_ignore_boot("m3")  # from now on: acknowledged, never kept
    rack.write_inventory({"m3": "bookworm"})
    rack.start()
    machine_id = rack.machine_id("m3")
    cause = rack.failure(machine_id)
    assert cause.startswith("boot_device: "), cause
    assert "read back as" in cause and "not disk" in cause, cause
    assert racked.machine.boots == ["rescue"]  # never rebooted into a disk it cannot boot
    wanted = rack.installation(machine_id).wanted
    assert wanted is not None and wanted.pending and wanted.step is None
    assert rack.cp is not None
    holds = rack.cp.db.read(lambda tx: bmdb.holds_of(tx, machine_id))
    assert [(h.kind, h.reason) for h in holds] == [
        ("quarantine", "an installation failed 1 times in a row")]


def test_firmware_that_ignores_the_override_boots_the_rescue_system_and_is_named(
        rack: Rack) -> None:
    rack.plane()
    racked = rack.ipmi("m4", ignore_boot_override=True)
    rack.write_inventory({"m4": "bookworm"})
    rack.start()
    machine_id = rack.machine_id("m4")
    cause = rack.failure(machine_id)
    assert cause.startswith("taking_over: SSH answered with host key "), cause
    assert key_line_fingerprint(racked.machine.rescue_host_key) in cause
    assert "did not boot the installed system (generation 1)" in cause, cause
    assert racked.machine.boots == ["rescue", "rescue"]


def test_a_system_that_never_starts_sshd_fails_at_its_deadline(rack: Rack) -> None:
    lacking = os_image("bookworm", without=("/usr/sbin/sshd",))
    rack.catalog({"bookworm": rack.image, "no-sshd": lacking})
    rack.plane(SHEPHERD_INSTALL_SSH_DEADLINE="20")
    racked = rack.redfish("m5")
    rack.write_inventory({"m5": "no-sshd"})
    rack.start()
    machine_id = rack.machine_id("m5")
    cause = rack.failure(machine_id)
    assert cause == ("taking_over: no SSH banner within 20 s of power on (the installed "
                     "system (generation 1))"), cause
    assert racked.machine.booted is None and racked.machine.boots == ["rescue", "disk"]
    assert "disk: " in (racked.machine.last_boot or "")
