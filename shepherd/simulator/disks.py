"""A simulated machine's disk, and the system it boots: the rescue system or its disk's.

Real racks install operating systems (``shepherd.agent.installer``, ``identity``): the
agent on a rescue system writes an image to a whole disk and the installed system's
identity into it, then the BMC boots the disk. The simulator's machines do the same
without root (``shepherd up`` runs as a normal user): no loop device, no mount.

* The disk is a sparse regular file, ``SANDBOX/root/dev/sda``, inside a *fake system
  root* the device's agent reads instead of "/" (``SHEPHERD_AGENT_SYS_ROOT``, set in
  the environment of the device's commands): ``sys/block/sda/{dev,size}`` describe it,
  ``proc/mounts`` and ``proc/swaps`` are empty (the installer checks them), and the
  host's CPU, memory and NICs are linked in so hardware reports stay what they were.
  The installer accepts such a file only in a root other than "/"
  (``installer.simulated_file``); ``device=/dev/sda`` names it.
* At power on the device boots what firmware would (``boot_choice``): the override
  its BMC holds (``Pxe``/``Cd``: the rescue system; ``Hdd``: the disk), or, without
  one, the disk if it can boot. Booting the disk reads the installed system off it
  with ``debugfs`` at the root partition's offset (``read_installed``): its host key
  and ``authorized_keys`` become what the device's SSH presents and accepts, and its
  installation marker is copied into the fake root (where the agent's hardware report
  reads it). The rescue system is the device's own host key and the project's keys,
  no marker. A disk that cannot boot leaves the machine dark (SSH refused).

A disk *can boot* when its GPT has a root partition (``identity.find_root``) holding
an ext filesystem with an ed25519 host key: the demo image ships none, so only an
installed disk boots.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from shepherd.agent import identity, installer
from shepherd.simulator.ssh import host_key_from_text

DISK_NAME = "sda"
#: The device selector an installation names the simulated disk by.
DISK_SELECTOR = f"device=/dev/{DISK_NAME}"
DEFAULT_DISK_SIZE = 64 << 20
#: ``/sys/block/sda/dev``: SCSI disk 0's numbers, as a machine's first disk has.
DISK_DEV = "8:0"
ROOT_DIR = "root"
RESCUE, DISK, DARK = "rescue", "disk", "dark"
#: Host files linked into the fake root, so the agent reports the host's hardware as it
#: did with "/" for its root.
HOST_FILES = ("proc/cpuinfo", "proc/meminfo", "sys/class/net")
#: The kernel's hostname: the host's under the rescue system, the disk's once booted.
HOSTNAME = "proc/sys/kernel/hostname"
DEBUGFS_TIMEOUT = 30.0
#: What firmware boots for a BMC's ``BootSourceOverrideTarget`` (lower-cased).
DISK_TARGETS = frozenset({"hdd", "sdcard"})
RESCUE_TARGETS = frozenset({"pxe", "cd", "usb", "uefihttp", "floppy"})
NO_OVERRIDE = frozenset({"", "none"})


@dataclass(frozen=True)
class Installed:
    """The system on a disk, as read off it: what the machine presents once booted."""

    host_key: str                   # OpenSSH private key text (never logged)
    authorized_keys: tuple[str, ...]
    marker: bytes | None            # /etc/shepherd/installation.json as written
    hostname: str

    def key_blobs(self) -> set[str]:
        """The base64 blobs root logins are accepted with (options before the type are
        allowed, as in any authorized_keys file)."""
        blobs = set()
        for line in self.authorized_keys:
            fields = line.split()
            for index, field in enumerate(fields[:-1]):
                if field.startswith(("ssh-", "ecdsa-", "sk-")):
                    blobs.add(fields[index + 1])
                    break
        return blobs


class DiskError(Exception):
    """The disk cannot boot; the message says why (one line)."""


def root_of(sandbox: Path) -> Path:
    return sandbox / ROOT_DIR


def disk_of(sandbox: Path) -> Path:
    return root_of(sandbox) / "dev" / DISK_NAME


def has_disk(sandbox: Path) -> bool:
    return disk_of(sandbox).is_file()


def attach(sandbox: Path, size: int = DEFAULT_DISK_SIZE) -> Path:
    """The device's fake root with its disk (a sparse file of ``size`` bytes), made if
    missing: an existing disk keeps its bytes and size (what a restart finds)."""
    if size < 1 << 20 or size % 512:
        raise ValueError(f"a simulated disk's size must be a multiple of 512 bytes, at "
                         f"least 1 MiB, not {size}")
    root = root_of(sandbox)
    disk = disk_of(sandbox)
    disk.parent.mkdir(parents=True, exist_ok=True)
    if not disk.exists():
        with disk.open("xb") as handle:
            handle.truncate(size)
    block = root / "sys" / "block" / DISK_NAME
    block.mkdir(parents=True, exist_ok=True)
    (block / "dev").write_text(DISK_DEV + "\n")
    (block / "size").write_text(f"{disk.stat().st_size // 512}\n")
    (root / "proc").mkdir(exist_ok=True)
    for name in ("mounts", "swaps"):
        (root / "proc" / name).write_text("" if name == "mounts" else
                                          "Filename\tType\tSize\tUsed\tPriority\n")
    for name in HOST_FILES:
        link = root / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink() and Path("/", name).exists():
            link.symlink_to(Path("/", name))
    return root


#: What a simulated machine's DMI names as its product and vendor.
DMI_PRODUCT, DMI_VENDOR = "Shepherd simulated machine", "Shepherd"


def write_dmi(sandbox: Path, system_uuid: str) -> None:
    """The machine's SMBIOS identity in its fake root (``/sys/class/dmi/id``), as the
    kernel shows it to root: the UUID its BMC reports for it, a product and a vendor;
    no serial (the emulated BMC reports none either)."""
    dmi = root_of(sandbox) / "sys" / "class" / "dmi" / "id"
    dmi.mkdir(parents=True, exist_ok=True)
    for name, value in (("product_uuid", system_uuid), ("product_name", DMI_PRODUCT),
                        ("sys_vendor", DMI_VENDOR)):
        (dmi / name).write_text(value + "\n")


def boot_choice(target: str | None, bootable: bool) -> str:
    """What firmware boots at power on: a disk override boots the disk (``DARK`` when it
    cannot boot, as firmware that finds nothing stays at its prompt); a network or CD
    override, the rescue system; no override, the disk if it can boot, else the network.
    Any other target (``BiosSetup``...) boots nothing."""
    wanted = (target or "").strip().lower()
    if wanted in DISK_TARGETS:
        return DISK if bootable else DARK
    if wanted in RESCUE_TARGETS:
        return RESCUE
    if wanted in NO_OVERRIDE:
        return DISK if bootable else RESCUE
    return DARK


def read_installed(disk: Path) -> Installed:
    """The system installed on ``disk``, read by offset with ``debugfs``; ``DiskError``
    saying why the disk cannot boot."""
    program = identity.find_debugfs()
    if program is None:
        raise DiskError("debugfs not found (Debian package e2fsprogs)")
    try:
        root = identity.find_root(str(disk))
        fd = os.open(disk, os.O_RDONLY | os.O_CLOEXEC)
        try:
            identity.filesystem(fd, root)
        finally:
            os.close(fd)
    except installer.Outcome as outcome:
        raise DiskError(outcome.cause) from None
    except OSError as error:
        raise DiskError(f"cannot read {disk}: {error.strerror}") from None
    files = _dump(program, f"{disk}?offset={root.offset}", {
        "key": identity.HOST_KEY, "authorized": "/root/.ssh/authorized_keys",
        "marker": identity.MARKER_PATH, "hostname": "/etc/hostname"})
    if "key" not in files:
        raise DiskError(f"no {identity.HOST_KEY} on the root filesystem")
    key = files["key"].decode("utf-8", "replace")
    try:
        host_key_from_text(key)
    except ValueError:
        raise DiskError(f"{identity.HOST_KEY} is not an ed25519 private key") from None
    authorized = files.get("authorized", b"").decode("utf-8", "replace")
    return Installed(
        host_key=key,
        authorized_keys=tuple(line.strip() for line in authorized.splitlines()
                              if line.strip() and not line.lstrip().startswith("#")),
        marker=files.get("marker"),
        hostname=files.get("hostname", b"").decode("utf-8", "replace").strip())


def _dump(program: str, spec: str, paths: dict[str, str]) -> dict[str, bytes]:
    """The files of ``paths`` (name -> path on the filesystem) that exist, in one
    debugfs run: each dumped into a private directory, removed afterwards."""
    workdir = tempfile.mkdtemp(prefix="shepherd-sim-disk-")
    try:
        script = Path(workdir, "commands")
        script.write_text("".join(f"dump {path} {name}\n" for name, path in paths.items()))
        try:
            subprocess.run([program, "-f", str(script), spec], cwd=workdir,
                           stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=DEBUGFS_TIMEOUT, check=False)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise DiskError(f"debugfs could not read the disk: {error}") from None
        found = {}
        for name in paths:
            local = Path(workdir, name)
            if local.is_file():
                found[name] = local.read_bytes()
        return found
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def show(sandbox: Path, system: str, installed: Installed | None) -> None:
    """What the fake root says of the booted system: the installed system's marker and
    hostname; for the rescue system (or nothing booted) no marker, the host's name."""
    root = root_of(sandbox)
    marker = root / identity.MARKER_PATH.lstrip("/")
    hostname = root / HOSTNAME
    hostname.parent.mkdir(parents=True, exist_ok=True)
    hostname.unlink(missing_ok=True)
    booted = installed if system == DISK else None
    if booted is not None and booted.marker is not None:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_bytes(booted.marker)
    else:
        marker.unlink(missing_ok=True)
    if booted is not None and booted.hostname:
        hostname.write_text(booted.hostname + "\n")
    else:
        hostname.symlink_to(Path("/", HOSTNAME))
