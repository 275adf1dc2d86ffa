"""Machines that boot what their real emulated BMC says (``tests.support.bootable_machines``).

The installation's last steps (boot device to the disk, a power cycle, the installed
system answering SSH) are only as true as the machine that carries them out. So here
a real BMC (``ipmi_sim`` driven by ``ipmitool``, sushy-emulator driven over HTTP) powers
a machine on into its rescue system, the test writes a real OS image onto the machine's
disk, and after "boot the disk" and a reset it is the installed system that answers:
its own host key (read back from the disk), its own authorized_keys. A disk that
cannot boot leaves the machine dark, saying why.

The image is built from the same stock system as the rescue one, host keys included,
so the test gives the installed system its own keys first (``personalize``): otherwise
nothing here could tell which of the two answered.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest
import requests

from shepherd.providers import ssh_keys
from tests.support.bmc_fixtures import IpmiBmc, RedfishBmc, running_redfish
from tests.support.bootable_machines import (
    DISK,
    RESCUE,
    SETUP,
    BootableMachine,
    IpmiLink,
    RedfishLink,
    bootable_machine,
    firmware_choice,
    personalize,
    read_disk_file,
    require_bootable_machines,
)
from tests.support.disk_images import (
    LINUX_FILESYSTEM,
    MIB,
    SECTOR,
    OsImage,
    os_image,
)
from tests.support.servers import listening
from tests.support.simulator_fixtures import presented_host_key, refused
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.stock_machines, pytest.mark.timeout(600)]

#: The emulator lands a reset 1 to 11 s after acknowledging it, then the machine boots.
REDFISH_TIMEOUT = 40.0
BOOT_TIMEOUT = 20.0


@pytest.fixture(autouse=True)
def _requirements() -> None:
    require_bootable_machines()


@pytest.fixture
def key_path(tmp_path: Path) -> Path:
    path = tmp_path / "test_key"
    ssh_keys.load_or_create(path)
    return path


@pytest.fixture
def public_key(key_path: Path) -> str:
    return ssh_keys.public_key_path(key_path).read_text().strip()


@pytest.fixture
def machine(tmp_path: Path, public_key: str) -> Iterator[BootableMachine]:
    """A halted machine with a blank disk; its close checks that nothing is left
    attached over the disk, and here: nothing listens, nothing runs in its roots."""
    with bootable_machine(tmp_path / "m", public_key) as bootable:
        yield bootable
    assert not listening(bootable.address, bootable.port)
    assert processes_under(bootable.workdir) == []


@pytest.fixture
def image() -> OsImage:
    return os_image("bookworm")


@pytest.fixture
def ipmi_off(tmp_path: Path) -> Iterator[IpmiBmc]:
    bmc = IpmiBmc(tmp_path / "ipmi", power_on=False).start()
    try:
        yield bmc
    finally:
        bmc.stop()


# -- the cases ---------------------------------------------------------------------------


@pytest.mark.parametrize(("target", "bootable", "expected"), [
    ("Hdd", False, DISK), ("default", True, DISK), ("Pxe", True, RESCUE),
    ("cdrom", True, RESCUE), ("Cd", False, RESCUE), ("bios", True, SETUP),
    (None, True, DISK), ("none", False, RESCUE), ("None", True, DISK),
])
def test_firmware_boots_the_override_else_the_disk_then_the_network(
        target: str | None, bootable: bool, expected: str) -> None:
    assert firmware_choice(target, bootable) == expected


def test_an_unknown_boot_target_is_refused() -> None:
    with pytest.raises(ValueError, match="Floppy"):
        firmware_choice("Floppy", True)


def test_ipmi_powers_on_the_rescue_then_a_reset_boots_the_installed_disk(
        machine: BootableMachine, ipmi_off: IpmiBmc, image: OsImage, key_path: Path,
        public_key: str, tmp_path: Path) -> None:
    with IpmiLink(ipmi_off, machine) as link:
        assert machine.booted is None and refused(machine.address, machine.port)
        ipmitool(ipmi_off, "chassis", "power", "on")
        wait_until(lambda: machine.booted == RESCUE, BOOT_TIMEOUT, "the rescue system")
        assert presented_host_key(machine.address, machine.port) == machine.rescue_host_key
        assert ssh(machine, key_path, f"test -b {machine.disk} && echo disk") == "disk"

        disk_key = install(image, machine, tmp_path, public_key)
        ipmitool(ipmi_off, "chassis", "bootdev", "disk")
        ipmitool(ipmi_off, "chassis", "power", "reset")
        wait_until(lambda: machine.booted == DISK, BOOT_TIMEOUT, lambda: f"the disk: {link.events}")
        assert presented_host_key(machine.address, machine.port) == disk_key
        assert ssh(machine, key_path, "cat /etc/ssh/ssh_host_ed25519_key.pub").startswith(
            disk_key)

        ipmitool(ipmi_off, "chassis", "power", "off")
        wait_until(lambda: refused(machine.address, machine.port), BOOT_TIMEOUT,
                   "the machine's port closed")
    assert link.events == ["boot rescue", "halt", "boot disk", "halt"]
    assert machine.boots == [RESCUE, DISK]
    assert machine.booted is None


def test_redfish_powers_on_the_rescue_then_a_restart_boots_the_installed_disk(
        machine: BootableMachine, image: OsImage, key_path: Path, public_key: str,
        tmp_path: Path) -> None:
    with running_redfish(tmp_path / "redfish", (("node-1", "Off"),)) as bmc, \
            RedfishLink(bmc.emulator, "node-1", machine) as link:
        redfish(bmc, "PATCH", "", {"Boot": {"BootSourceOverrideTarget": "Pxe"}})
        redfish(bmc, "POST", "/Actions/ComputerSystem.Reset", {"ResetType": "On"})
        wait_until(lambda: machine.booted == RESCUE, REDFISH_TIMEOUT, "the rescue system")
        assert presented_host_key(machine.address, machine.port) == machine.rescue_host_key

        disk_key = install(image, machine, tmp_path, public_key)
        redfish(bmc, "PATCH", "", {"Boot": {"BootSourceOverrideTarget": "Hdd"}})
        redfish(bmc, "POST", "/Actions/ComputerSystem.Reset", {"ResetType": "ForceRestart"})
        wait_until(lambda: machine.booted == DISK, REDFISH_TIMEOUT,
                   lambda: f"the disk: {link.events}")
        assert presented_host_key(machine.address, machine.port) == disk_key
        assert ssh(machine, key_path, "cat /etc/ssh/ssh_host_ed25519_key.pub").startswith(
            disk_key)

        redfish(bmc, "POST", "/Actions/ComputerSystem.Reset", {"ResetType": "ForceOff"})
        wait_until(lambda: refused(machine.address, machine.port), REDFISH_TIMEOUT,
                   "the machine's port closed")
    assert link.events == ["boot rescue", "halt", "boot disk", "halt"]


def test_firmware_that_ignores_the_override_boots_the_rescue_system(
        machine: BootableMachine, tmp_path: Path, image: OsImage, public_key: str) -> None:
    install(image, machine, tmp_path, public_key)
    bmc = IpmiBmc(tmp_path / "ipmi", power_on=True).start()
    try:
        ipmitool(bmc, "chassis", "bootdev", "disk")
        assert machine.disk_bootable()
        with IpmiLink(bmc, machine, ignore_boot_override=True) as link:
            assert machine.booted == RESCUE  # powered at the start, as its BMC says
            assert presented_host_key(machine.address, machine.port) == machine.rescue_host_key
        assert link.events == ["boot rescue"]
    finally:
        bmc.stop()


def test_a_disk_without_a_root_partition_leaves_the_machine_dark(
        machine: BootableMachine, ipmi_off: IpmiBmc) -> None:
    partition(machine.disk, "data")
    ipmitool(ipmi_off, "chassis", "bootdev", "disk")
    with IpmiLink(ipmi_off, machine) as link:
        ipmitool(ipmi_off, "chassis", "power", "on")
        wait_until(lambda: machine.last_boot, BOOT_TIMEOUT, "the boot's outcome")
        assert machine.last_boot == "disk: no root partition"
        assert machine.booted is None
        assert refused(machine.address, machine.port)
        assert "disk: no root partition" in machine.log()
    assert link.events == ["boot disk"]


@pytest.mark.parametrize(("prepare", "reason"), [
    ("blank", "disk: no root partition (no partition table)"),
    ("no filesystem", "disk: no ext4 filesystem on the root partition"),
    ("no sshd", "disk: no /usr/sbin/sshd on the root filesystem"),
])
def test_a_disk_that_cannot_boot_says_why(machine: BootableMachine, prepare: str,
                                          reason: str) -> None:
    if prepare != "blank":
        partition(machine.disk, "root")
    if prepare == "no sshd":
        subprocess.run(["mke2fs", "-q", "-F", "-t", "ext4", "-E", f"offset={MIB}",
                        machine.disk, "16M"], check=True, timeout=60)
    assert not machine.boot(DISK)
    assert (machine.last_boot, machine.booted) == (reason, None)
    assert refused(machine.address, machine.port)
    machine.halt()  # a dark machine halts too, and then boots again
    assert machine.boot(RESCUE)
    assert machine.boots == [DISK, RESCUE]


# -- helpers ---------------------------------------------------------------------------


def install(image: OsImage, machine: BootableMachine, tmp_path: Path,
            authorized_key: str) -> str:
    """Write ``image`` onto the machine's disk as the agent would (every byte, synced),
    give it its own host key and ``authorized_key``: return the host key, as read back
    from the disk's own files."""
    with image.raw.open("rb") as source, open(machine.disk, "r+b") as disk:
        while block := source.read(8 * MIB):
            disk.write(block)
        disk.flush()
        os.fsync(disk.fileno())
    personalize(machine.disk, tmp_path / "installed", authorized_key)
    line = read_disk_file(machine.disk, "/etc/ssh/ssh_host_ed25519_key.pub").split()
    disk_key = f"{line[0]} {line[1]}"
    assert disk_key != machine.rescue_host_key  # else nothing tells the systems apart
    return disk_key


def partition(device: str, name: str) -> None:
    """A GPT with one 64 MiB partition ``name`` at 1 MiB, holding nothing."""
    script = f"label: gpt\nstart={MIB // SECTOR}, size={64 * MIB // SECTOR}, " \
             f"type={LINUX_FILESYSTEM}, name={name}\n"
    subprocess.run(["sfdisk", "--quiet", "--no-reread", "--no-tell-kernel", device],
                   input=script, text=True, check=True, timeout=30)


def ipmitool(bmc: IpmiBmc, *args: str) -> None:
    done = bmc.ipmitool(*args)
    assert done.returncode == 0, f"ipmitool {' '.join(args)}: {done.stderr.strip()}"


def redfish(bmc: RedfishBmc, method: str, suffix: str, body: dict[str, object]) -> None:
    emulator = bmc.emulator
    response = requests.request(method, emulator.base_url + emulator.system_path("node-1")
                                + suffix, json=body, auth=emulator.auth, timeout=10)
    assert response.status_code in (200, 204), f"{method} {suffix}: {response.text}"


def ssh(machine: BootableMachine, key_path: Path, command: str) -> str:
    """``command``'s output as root on the machine, logged in with the test's key.
    A refused or dropped login fails with the machine's log (its sshd's own word)."""
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
    try:
        client.connect(machine.address, machine.port, username="root",
                       key_filename=str(key_path), look_for_keys=False, allow_agent=False,
                       timeout=10)
        _, stdout, _ = client.exec_command(command, timeout=20)
        return stdout.read().decode().strip()
    except paramiko.SSHException as error:
        raise AssertionError(f"ssh to {machine}: {error}; its log:\n{machine.log()}") from error
    finally:
        client.close()


def processes_under(directory: Path) -> list[int]:
    """Host pids of processes whose root lies under ``directory`` (a machine's systems)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/root").startswith(str(directory)):
                    found.append(int(entry))
            except OSError:
                continue
    return found


def test_a_broken_link_fails_at_its_stop(machine: BootableMachine, ipmi_off: IpmiBmc) -> None:
    """A boot device no firmware here knows stops the link: its stop raises it."""
    (ipmi_off.directory / "boot").write_text("usb\n")
    link = IpmiLink(ipmi_off, machine).start()
    ipmitool(ipmi_off, "chassis", "power", "on")
    wait_until(lambda: link.events, BOOT_TIMEOUT, "the link to act")
    with pytest.raises(ValueError, match="usb"):
        link.stop()
    assert link.events[0].startswith("error: ") and machine.boots == []
