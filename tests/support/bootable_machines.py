"""Machines that really boot what their BMC says: a rescue system or their own disk.

The end-to-end installation tests need the part no stock machine has: after the agent
wrote an image, Shepherd sets the boot device to the disk through the BMC and power
cycles the machine, and what answers SSH next must be the *installed* system (its own
host keys, its own ``authorized_keys``), or nothing at all if the disk cannot boot.

- ``BootableMachine``: one machine, one loopback address and port for its whole life
  (a real machine keeps its IP across reboots), one disk (a loop device), and two things
  to boot. ``boot("rescue")``: the stock Debian rootfs on a fresh overlay with the disk's
  node inside, as a network-booted or virtual-media rescue system the agent runs in.
  ``boot("disk")``: the disk's GPT read, its partition named "root" attached by offset
  and mounted as the machine's root, its own ``/usr/sbin/sshd`` as pid 1. A disk that
  cannot boot leaves the machine dark, ``last_boot`` saying why.
- ``firmware_choice``: what the firmware boots at power on, from the BMC's boot
  override and whether the disk can boot.
- ``RedfishLink`` and ``IpmiLink``: threads that watch a real emulated BMC (power state,
  resets, boot override) and halt and boot the machine on its transitions.

There is no firmware, kernel or kexec here (disks-offline.md, "Booting"): a machine
boots by starting the chosen system's sshd in new PID and mount namespaces, as
``minimal_systems`` runs a stock machine. The root partition is mounted *inside* the
machine's mount namespace, never on the host: a host mount would be copied into every
namespace started meanwhile (another test's stock machine), which would then hold the
filesystem, and the loop device, for as long as that other machine lives. Inside, the
mount goes with the namespace; ``halt`` detaches the loop device, which waits until the
kernel let go of it, so the disk can be rewritten at once (reinstallation cycles).

Needs what ``minimal_systems`` and ``disk_images`` need, plus ``debugfs`` (e2fsprogs):
``require_bootable_machines`` skips with the one-line reason otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import pytest
import requests

from shepherd.providers import ssh_keys
from shepherd.simulator.redfish import RedfishEmulator
from tests.support.bmc_fixtures import IpmiBmc
from tests.support.disk_images import (
    MIB,
    ROOT_NAME,
    attached,
    loop_disk,
    partitions,
    require_disks,
)
from tests.support.minimal_systems import (
    ADDRESS,
    HIDE_HOST_DMI,
    Changes,
    StockMachine,
    exec_sshd,
    host_key_of,
    kill_machine,
    read_log,
    require_minimal_systems,
    rootfs,
    run_in_namespaces,
)
from tests.support.servers import free_port, listening
from tests.support.waiting import wait_until

log = logging.getLogger(__name__)

DISK, RESCUE = "disk", "rescue"
#: IPMI's "bios" override: the firmware's setup screen, which boots nothing.
SETUP = "setup"
SOURCES = (DISK, RESCUE, SETUP)
#: Boot overrides as either BMC spells them (Redfish's BootSourceOverrideTarget,
#: ipmitool's bootdev as ipmi_sim tells its chassis script), lower-cased.
DISK_TARGETS = frozenset({"hdd", "default", "disk"})
RESCUE_TARGETS = frozenset({"pxe", "cd", "cdrom", "uefihttp", "network"})
SETUP_TARGETS = frozenset({"bios", "biossetup"})
NO_OVERRIDE = frozenset({"", "none"})
#: What a rescue system needs to reach its disk: a 320 MiB image and some room.
DISK_SIZE = 384 * MIB
POLL_INTERVAL = 0.2
HALT_TIMEOUT = 10.0
PROBE_TIMEOUT = 30.0
#: A disk system's script prints this before giving up, so ``last_boot`` says why.
DARK_MARK = "dark: "


def require_bootable_machines() -> None:
    """Skip, saying why in one line, where machines cannot be run or disks made."""
    require_minimal_systems()
    require_disks()
    if shutil.which("debugfs") is None:
        pytest.skip("bootable machines need debugfs (Debian package e2fsprogs)")


def firmware_choice(boot_target: str | None, disk_bootable: bool) -> str:
    """What the firmware boots at power on: an override to the disk boots the disk
    (bootable or not: the machine then stays dark, as firmware that finds nothing to
    boot does); to the network or a CD, the rescue system; no override, the usual
    order: the disk if it can boot, else the network. ValueError on a target no BMC
    here sends, so that a new one is decided on, not guessed."""
    target = (boot_target or "").strip().lower()
    if target in DISK_TARGETS:
        return DISK
    if target in RESCUE_TARGETS:
        return RESCUE
    if target in SETUP_TARGETS:
        return SETUP
    if target in NO_OVERRIDE:
        return DISK if disk_bootable else RESCUE
    raise ValueError(f"no firmware behaviour for boot target {boot_target!r}")


def disk_node_lines(device: str) -> tuple[str, ...]:
    """Script lines that make the loop disk a machine's own: its node in the machine's
    /dev and a udev style by-id link (as part 1's ``disk_lines``)."""
    name = device.removeprefix("/dev/")
    return (f'touch "$M/dev/{name}"', f'mount --bind {device} "$M/dev/{name}"',
            'mkdir -p "$M/dev/disk/by-id"',
            f'ln -sf ../../{name} "$M/dev/disk/by-id/test-{name}"')


class BootableMachine:
    """One machine: ``address:port`` fixed for its life, ``disk`` (a loop device the
    caller owns), and a rescue system (``rescue_root``, whose root logs in with
    ``authorized_key``). Safe to call from a link's thread and a test's at once.

    ``booted``: what runs now ("disk", "rescue") or None; ``boots``: every boot
    asked, oldest first; ``last_boot``: the last boot's outcome, its source or, for a
    machine left dark, "<source>: why". Each boot's log is kept in ``workdir``."""

    def __init__(self, workdir: Path, disk_device: str, rescue_root: Path,
                 authorized_key: str, *, port: int | None = None) -> None:
        self.workdir = workdir
        self.disk = disk_device
        self.rescue_root = rescue_root
        self.authorized_key = authorized_key
        self.port = port or free_port()
        self.address = ADDRESS
        self.booted: str | None = None
        self.boots: list[str] = []
        self.last_boot: str | None = None
        self.log_path: Path | None = None
        self._rescue: StockMachine | None = None
        self._process: subprocess.Popen[bytes] | None = None
        #: What boot("disk") attached (the root partition's loop device): detached by halt.
        self._attached = contextlib.ExitStack()
        self._lock = threading.RLock()
        workdir.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return (f"BootableMachine({self.address}:{self.port}, disk={self.disk}, "
                f"booted={self.booted})")

    def __enter__(self) -> BootableMachine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def rescue_host_key(self) -> str:
        return host_key_of(self.rescue_root)

    def log(self) -> str:
        """The last boot's log."""
        return read_log(self.log_path) if self.log_path else ""

    # -- booting ---------------------------------------------------------------------

    def boot(self, source: str) -> bool:
        """Start ``source``'s system (one of ``SOURCES``) on a halted machine: True once
        its sshd listens, False if the machine stays dark (``last_boot`` says why)."""
        if source not in SOURCES:
            raise ValueError(f"a machine boots one of {SOURCES}, not {source!r}")
        with self._lock:
            if self.booted is not None:
                raise RuntimeError(f"{self}: halt it before booting {source}")
            self.boots.append(source)
            directory = self.workdir / f"boot-{len(self.boots)}-{source}"
            directory.mkdir()
            self.log_path = directory / "machine.log"
            if source == RESCUE:
                return self._boot_rescue(directory)
            if source == DISK:
                return self._boot_disk(directory)
            return self._dark(f"{SETUP}: the firmware's setup screen boots nothing")

    def _boot_rescue(self, directory: Path) -> bool:
        rescue = StockMachine(self.rescue_root, directory, self.authorized_key,
                              Changes(extra_lines=disk_node_lines(self.disk)), port=self.port)
        self.log_path = rescue.log_path
        self._rescue = rescue.start()
        return self._up(RESCUE)

    def _boot_disk(self, directory: Path) -> bool:
        """Mount the root partition by offset as the machine's root, inside its mount
        namespace (see the module's docstring), and run the disk's own sshd."""
        problem = self.disk_problem()
        if problem is not None:
            return self._dark(problem)
        root = self._root_partition()
        assert root is not None  # disk_problem found it
        device = self._attached.enter_context(
            attached(Path(self.disk), offset=root["start"], sizelimit=root["size"]))
        try:
            self._process = run_in_namespaces(self._disk_script(device, directory),
                                              directory / "machine.log", f"{self}'s disk")
        except RuntimeError:
            self._attached.close()
            return self._dark(self._disk_failure())
        return self._up(DISK)

    def _disk_script(self, device: str, directory: Path) -> str:
        """The installed system as a boot leaves it: its root read-write, /run a tmpfs
        (so sshd's privilege separation directory is no write to the disk)."""
        root = directory / "root"
        root.mkdir()
        return "\n".join([
            "set -eu",
            f'dark() {{ echo "{DARK_MARK}{DISK}: $*"; exit 3; }}',
            f"M={shlex.quote(str(root))}",
            f'mount -t ext4 {device} "$M" || dark "no ext4 filesystem on the root partition"',
            '[ -x "$M/usr/sbin/sshd" ] || dark "no /usr/sbin/sshd on the root filesystem"',
            'mkdir -p "$M/run" "$M/proc" "$M/sys"',
            'mount -t tmpfs -o mode=0755 tmpfs "$M/run"',
            'mkdir -p "$M/run/sshd"',
            'mount -t proc proc "$M/proc"',
            'mount -t sysfs sysfs "$M/sys"',
            HIDE_HOST_DMI,
            exec_sshd(self.port, self.address),
        ])

    def _disk_failure(self) -> str:
        """Why the disk's system did not come up: its script's own word, else the last
        line sshd (or mount) said."""
        lines = [line for line in self.log().splitlines() if line.strip()]
        for line in reversed(lines):
            if line.startswith(DARK_MARK):
                return line.removeprefix(DARK_MARK)
        return f"{DISK}: its sshd did not start: {lines[-1] if lines else 'no output'}"

    def _up(self, source: str) -> bool:
        self.booted = self.last_boot = source
        log.info("%s booted %s", self, source)
        return True

    def _dark(self, reason: str) -> bool:
        """The machine is powered but nothing answers: said in ``last_boot`` and its log."""
        self.booted, self.last_boot = None, reason
        if self.log_path is not None:
            with self.log_path.open("a") as handle:
                handle.write(f"{DARK_MARK}{reason}\n")
        log.info("%s stays dark: %s", self, reason)
        return False

    # -- the disk, as firmware sees it --------------------------------------------

    def disk_bootable(self) -> bool:
        return self.disk_problem() is None

    def disk_problem(self) -> str | None:
        """Why the disk cannot boot ("disk: no root partition"...), or None. Read
        without mounting anything (sfdisk, then debugfs by offset), so that firmware
        can ask on every power on."""
        try:
            table = partitions(self.disk)
        except RuntimeError as error:
            return f"{DISK}: unreadable partition table ({error})"
        root = self._root_partition(table)
        if root is None:
            return f"{DISK}: no root partition" + ("" if table else " (no partition table)")
        probe = subprocess.run(["debugfs", "-R", "stat /usr/sbin/sshd",
                                f"{self.disk}?offset={root['start']}"],
                               capture_output=True, text=True, timeout=PROBE_TIMEOUT,
                               check=False)
        if probe.returncode != 0:
            return f"{DISK}: no ext4 filesystem on the root partition"
        if "not found" in probe.stderr:
            return f"{DISK}: no /usr/sbin/sshd on the root filesystem"
        return None

    def _root_partition(self, table: list[dict[str, Any]] | None = None
                        ) -> dict[str, Any] | None:
        table = partitions(self.disk) if table is None else table
        return next((entry for entry in table if entry["name"] == ROOT_NAME), None)

    # -- halting ---------------------------------------------------------------------

    def halt(self) -> None:
        """Power off: kill whatever runs (its whole PID namespace), wait until nothing
        answers on the port, detach what boot("disk") attached. Harmless when halted."""
        with self._lock:
            rescue, self._rescue = self._rescue, None
            process, self._process = self._process, None
            try:
                if rescue is not None:
                    rescue.stop()
                kill_machine(process)
                wait_until(lambda: not listening(self.address, self.port), HALT_TIMEOUT,
                           f"{self}'s port to close", every=0.05)
            finally:
                self._attached.close()
                self.booted = None

    def close(self) -> None:
        """Halt; after it nothing of this machine is running, mounted or attached (the
        root partition's mount went with the machine's mount namespace; its loop device
        is checked gone here, since a disk still held cannot be detached or rewritten)."""
        self.halt()
        left = loops_over(self.disk)
        if left:
            raise RuntimeError(f"{self}: still attached over the disk: {', '.join(left)}")


def loops_over(device: str) -> list[str]:
    """The loop devices backed by ``device`` (what boot("disk") attaches over it)."""
    done = subprocess.run(["losetup", "--noheadings", "--output", "NAME", "--associated",
                           device], capture_output=True, text=True, timeout=PROBE_TIMEOUT,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"losetup --associated {device} failed: {done.stderr.strip()}")
    return done.stdout.split()


@contextlib.contextmanager
def bootable_machine(workdir: Path, authorized_key: str, *, disk_size: int = DISK_SIZE,
                     suite: str = "bookworm") -> Iterator[BootableMachine]:
    """A halted machine with a blank loop disk of ``disk_size`` bytes and ``suite``'s
    stock rescue system; on exit halted, its disk detached and removed."""
    workdir.mkdir(parents=True, exist_ok=True)
    with loop_disk(workdir / "disk", disk_size) as device:
        machine = BootableMachine(workdir / "machine", device, rootfs(suite), authorized_key)
        with machine:
            yield machine


def personalize(disk: str, workdir: Path, authorized_key: str) -> str:
    """Give the system on ``disk``'s root partition its own ed25519 host key (new, kept
    in ``workdir``) and ``authorized_key`` for root, as an installation's first-boot
    configuration would; return the host key line. Written with debugfs by offset: the
    disk must not be mounted (its machine halted, or running the rescue system).

    Why: an image built from the stock rootfs has the rescue system's host key and no
    authorized_keys, so a test could not tell which of the two answers."""
    workdir.mkdir(parents=True, exist_ok=True)
    private = workdir / "ssh_host_ed25519_key"
    ssh_keys.load_or_create(private)
    public = ssh_keys.public_key_path(private)
    keys = workdir / "authorized_keys"
    keys.write_text(authorized_key.strip() + "\n")
    root = next((entry for entry in partitions(disk) if entry["name"] == ROOT_NAME), None)
    if root is None:
        raise RuntimeError(f"{disk}: no root partition to personalize")
    commands = workdir / "debugfs.commands"
    commands.write_text("\n".join([
        "rm /etc/ssh/ssh_host_ed25519_key", "rm /etc/ssh/ssh_host_ed25519_key.pub",
        f"write {private} /etc/ssh/ssh_host_ed25519_key",
        f"write {public} /etc/ssh/ssh_host_ed25519_key.pub",
        "mkdir /root/.ssh", "rm /root/.ssh/authorized_keys",
        f"write {keys} /root/.ssh/authorized_keys", ""]))
    done = subprocess.run(["debugfs", "-w", "-f", str(commands), f"{disk}?offset={root['start']}"],
                          capture_output=True, text=True, timeout=PROBE_TIMEOUT, check=False)
    if done.returncode != 0 or "Allocated inode" not in done.stdout:
        raise RuntimeError(f"debugfs could not personalize {disk}: {done.stderr.strip()}")
    return " ".join(public.read_text().split()[:2])


def read_disk_file(disk: str, path: str) -> str:
    """A file of the system on ``disk``'s root partition, read by offset (debugfs)."""
    root = next((entry for entry in partitions(disk) if entry["name"] == ROOT_NAME), None)
    if root is None:
        raise RuntimeError(f"{disk}: no root partition")
    done = subprocess.run(["debugfs", "-R", f"cat {path}", f"{disk}?offset={root['start']}"],
                          capture_output=True, text=True, timeout=PROBE_TIMEOUT, check=False)
    if done.returncode != 0 or not done.stdout:
        raise RuntimeError(f"debugfs could not read {path} on {disk}: {done.stderr.strip()}")
    return done.stdout


# -- links: a BMC's power reaches the machine -------------------------------------------


class Link:
    """A thread that watches a BMC every ``interval`` seconds and makes its power
    transitions the machine's: on → boot (per ``firmware_choice``, or the rescue system
    always with ``ignore_boot_override``), off → halt, a reset → halt then boot.

    ``events``: what the link did ("boot rescue", "halt"...). An exception stops the
    link, is recorded there ("error: ...") and is raised again by ``stop``: a broken
    link fails its test instead of leaving a machine that silently ignores its BMC."""

    name = "link"

    def __init__(self, machine: BootableMachine, *, ignore_boot_override: bool = False,
                 interval: float = POLL_INTERVAL) -> None:
        self.machine = machine
        self.ignore_boot_override = ignore_boot_override
        self.interval = interval
        self.events: list[str] = []
        self.error: BaseException | None = None
        #: Whether the machine has power: a dark machine is on too.
        self._on = False
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Self:
        """Power the machine as its BMC says now, then follow the BMC."""
        self._start_reading()
        self._follow(restarted=False)
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"{self.name}-{self.machine.port}")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=HALT_TIMEOUT + 30)
            self._thread = None
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        try:
            while not self._stopping.wait(self.interval):
                self._follow(restarted=self._restarted())
        except BaseException as error:
            self.error = error
            self.events.append(f"error: {error}")
            log.exception("%s of %s failed", self.name, self.machine)

    def _follow(self, *, restarted: bool) -> None:
        """One look at the BMC. A reset is asked before power is read (``_restarted``
        first): a reset between the two reads is then seen as power off now and a
        restart already handled next time, never as two reboots."""
        powered = self._powered()
        if restarted and self._on:
            self._power_off()
        if powered and not self._on:
            self._power_on()
        elif not powered and self._on:
            self._power_off()

    def _power_on(self) -> None:
        source = (RESCUE if self.ignore_boot_override
                  else firmware_choice(self._boot_target(), self.machine.disk_bootable()))
        self._on = True
        self.events.append(f"boot {source}")
        self.machine.boot(source)

    def _power_off(self) -> None:
        self._on = False
        self.events.append("halt")
        self.machine.halt()

    # What a BMC tells; each subclass reads its own.
    def _start_reading(self) -> None:
        """Take the BMC's reset count as seen: resets before the link are history."""
        raise NotImplementedError

    def _restarted(self) -> bool:
        """Whether the BMC was asked a reset since the last look."""
        raise NotImplementedError

    def _powered(self) -> bool:
        raise NotImplementedError

    def _boot_target(self) -> str | None:
        raise NotImplementedError


class IpmiLink(Link):
    """``ipmi_sim``'s chassis, as its chassis script keeps it: the power file, the reset
    counter, and the boot file (``none`` while absent: no override yet). An override
    stays until changed, as on BMCs that ignore IPMI's once/persistent bit.

    The script rewrites its files in place (``echo > file``): a look may find one
    empty, mid-write. Such a look keeps the last value read, where ``IpmiBmc.powered``
    would read "off" (and a needless power on would reboot the machine)."""

    name = "ipmi-link"

    def __init__(self, bmc: IpmiBmc, machine: BootableMachine, **options: Any) -> None:
        super().__init__(machine, **options)
        self.bmc = bmc
        self._resets = 0
        self._power = False
        self._boot = "none"

    def _read(self, name: str) -> str | None:
        """The chassis file ``name``, None while absent or mid-write (empty)."""
        path = self.bmc.directory / name
        text = path.read_text().strip() if path.exists() else ""
        return text or None

    def _start_reading(self) -> None:
        self._resets = int(self._read("resets") or 0)

    def _restarted(self) -> bool:
        resets = int(self._read("resets") or self._resets)
        restarted, self._resets = resets > self._resets, resets
        return restarted

    def _powered(self) -> bool:
        power = self._read("power")
        if power is not None:
            self._power = power == "1"
        return self._power

    def _boot_target(self) -> str | None:
        """The boot file, "none" while absent (ipmi_sim's own initial value)."""
        if (self.bmc.directory / "boot").exists():
            self._boot = self._read("boot") or self._boot
        return self._boot


class RedfishLink(Link):
    """System ``system_name`` of a sushy-emulator (fake driver). Power is what the
    system's JSON says (each read also lets a pending change land: the fake driver
    applies a reset 1 to 11 s late, on reads). A restart (ForceRestart,
    GracefulRestart) reads Off at once and On when it lands; it can land before a look
    sees the Off, so restarts are also counted in the emulator's log of resets.

    A frozen system's resets are logged but never done: the link leaves its machine
    alone for those, as the frozen BMC does (read from the emulator at each look)."""

    name = "redfish-link"

    def __init__(self, emulator: RedfishEmulator, system_name: str, machine: BootableMachine,
                 **options: Any) -> None:
        super().__init__(machine, **options)
        self.emulator = emulator
        self.system_name = system_name
        self._restarts = 0
        self._system: dict[str, Any] = {}

    def _start_reading(self) -> None:
        self._restarts = self._restart_count()

    def _restart_count(self) -> int:
        return sum("Restart" in kind for kind in self.emulator.resets(self.system_name))

    def _restarted(self) -> bool:
        count = self._restart_count()
        restarted, self._restarts = count > self._restarts, count
        return restarted and not self._frozen()

    def _frozen(self) -> bool:
        uuid = self.emulator.system_path(self.system_name).rsplit("/", 1)[-1]
        return uuid in self.emulator._frozen

    def _powered(self) -> bool:
        """Reads the system once per look: its power and boot override come from the
        same read, the override being what the firmware finds at this power on."""
        emulator = self.emulator
        verify = str(emulator.tls[0]) if emulator.tls else True
        response = requests.get(emulator.base_url + emulator.system_path(self.system_name),
                                auth=emulator.auth, timeout=5, verify=verify)
        response.raise_for_status()
        self._system = response.json()
        return bool(self._system["PowerState"] == "On")

    def _boot_target(self) -> str | None:
        boot = self._system.get("Boot") or {}
        if boot.get("BootSourceOverrideEnabled") == "Disabled":
            return None
        target = boot.get("BootSourceOverrideTarget")
        return str(target) if target is not None else None
