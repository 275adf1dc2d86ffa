"""Real disks for the OS-installation tests: loop devices, and a real OS image to write.

- ``loop_disk``: a sparse file attached as ``/dev/loopN``, a real block device
  (``O_DIRECT``, ``fsync``, ``BLKGETSIZE64`` work as on a disk); ``attached`` attaches
  an existing file, or a slice of one (a partition, by offset).
- ``os_image``: a raw disk image as an operator would serve it: GPT, one partition
  named "root" at 1 MiB holding an ext4 filesystem labelled "root", filled from a stock
  machine's root filesystem (``minimal_systems.rootfs``: python3 and openssh-server).
  Plus its gzip and zstd copies, the three formats of the contract.

The image is built without mounting anything (``sfdisk`` script, ``mke2fs -d``, ``dd``),
since nothing here needs the kernel to understand it: loop devices show no partition
nodes on our machines (docs: disks-offline.md), so a test reads the table itself
(``partitions``) and mounts the root by offset.

Images are cached between runs under ``SHEPHERD_TEST_IMAGE_CACHE`` (default
``minimal_systems.CACHE.parent / "images"``), keyed
by ``RECIPE``, the root filesystem's recipe, suite and size. Invariants, each enforced
in ``os_image``: a cached directory is complete (built beside it, renamed in last);
only one process builds a given image at a time (an ``flock`` on its lock file, which
the kernel releases when a builder dies); the raw image's sha256 and size are recorded
beside it, so a later run does not re-read the whole image.

Needs root (loop devices), losetup, sfdisk (Debian package fdisk), mke2fs, zstd, and
for an image not yet cached what ``minimal_systems`` needs. ``require_disks`` skips
with the one-line reason otherwise.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support import minimal_systems

IMAGES = Path(os.environ.get("SHEPHERD_TEST_IMAGE_CACHE",
                           str(minimal_systems.CACHE.parent / "images")))
#: Bump when the build steps below change, so that cached images are rebuilt.
RECIPE = "1"
MIB = 2**20
SECTOR = 512
#: Where the root partition starts: 1 MiB, as every partitioning tool aligns it. The
#: last MiB is left free as well, for GPT's backup table.
ROOT_START = MIB
ROOT_NAME = "root"
#: GPT's "Linux filesystem" type.
LINUX_FILESYSTEM = "0FC63DAF-8483-4772-8E79-3D69D8477DE4"
BUILD_TIMEOUT = 900.0
#: How long a process waits for another one's build of the same image.
LOCK_TIMEOUT = 1800.0
LOSETUP_TIMEOUT = 30.0
#: ``losetup -d`` of a device still open (a mount, udev's probe) only marks it for
#: autoclear: it detaches when last closed, which we wait for this long.
DETACH_TIMEOUT = 10.0
METADATA = "image.json"
TOOLS = ("losetup", "sfdisk", "mke2fs", "debugfs", "zstd", "gzip", "dd")


class ImageTooSmall(ValueError):
    """The asked size cannot hold the root filesystem."""


def require_disks() -> None:
    """Skip, saying why in one line, where loop devices or the image tools are missing."""
    if os.geteuid() != 0:
        pytest.skip("loop disks and OS images need root (losetup)")
    for tool in TOOLS:
        if shutil.which(tool) is None:
            package = " (Debian package fdisk)" if tool == "sfdisk" else ""
            pytest.skip(f"loop disks and OS images need {tool}{package}: apt-get install it")
    if not Path("/dev/loop-control").exists():
        pytest.skip("loop disks need /dev/loop-control (the loop module)")


# -- loop devices -----------------------------------------------------------------------

@contextlib.contextmanager
def loop_disk(path: Path, size: int) -> Iterator[str]:
    """A blank disk of ``size`` bytes: ``path`` made a sparse file and attached; on exit,
    even on errors, detached and the file removed."""
    if size <= 0 or size % SECTOR:
        raise ValueError(f"a loop disk's size is a positive multiple of {SECTOR}: {size}")
    with path.open("xb") as file:
        file.truncate(size)
    try:
        with attached(path) as device:
            yield device
    finally:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def attached(path: Path, *, offset: int = 0, sizelimit: int = 0,
             read_only: bool = False) -> Iterator[str]:
    """``path`` (or its ``sizelimit`` bytes from ``offset``: a partition of an image) as
    a loop device, detached on exit."""
    command = ["losetup", "--find", "--show"]
    if offset:
        command += ["--offset", str(offset)]
    if sizelimit:
        command += ["--sizelimit", str(sizelimit)]
    if read_only:
        command.append("--read-only")
    device = _run([*command, str(path)], timeout=LOSETUP_TIMEOUT).strip()
    try:
        yield device
    finally:
        detach(device)


def detach(device: str) -> None:
    """Detach ``device`` and wait until it is really free (see ``DETACH_TIMEOUT``)."""
    _run(["losetup", "--detach", device], timeout=LOSETUP_TIMEOUT)
    backing = backing_file_path(device)
    deadline = time.monotonic() + DETACH_TIMEOUT
    while backing.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{device} is still attached {DETACH_TIMEOUT:.0f} s after "
                               "losetup --detach: something holds it open")
        time.sleep(0.05)


def backing_file_path(device: str) -> Path:
    """Where the kernel names a loop device's file; absent once it is detached."""
    return Path("/sys/block") / Path(device).name / "loop" / "backing_file"


def device_size(device: str) -> int:
    """A block device's size in bytes, as the kernel reports it (512-byte sectors)."""
    return int((Path("/sys/block") / Path(device).name / "size").read_text()) * SECTOR


# -- partition tables -----------------------------------------------------------------

def partitions(device_or_image: str | Path) -> list[dict[str, Any]]:
    """The partitions ``sfdisk -J`` reads on a disk or image file, ``start`` and ``size``
    in bytes; an empty list where there is no partition table at all."""
    done = subprocess.run(["sfdisk", "--json", str(device_or_image)], capture_output=True,
                          text=True, timeout=LOSETUP_TIMEOUT, check=False)
    if done.returncode != 0:
        if "does not contain a recognized partition table" in done.stderr:
            return []
        raise RuntimeError(f"sfdisk --json {device_or_image} failed: {done.stderr.strip()}")
    table = json.loads(done.stdout)["partitiontable"]
    sector = int(table.get("sectorsize", SECTOR))
    return [{**entry, "label": table["label"], "start": entry["start"] * sector,
             "size": entry["size"] * sector, "name": entry.get("name", "")}
            for entry in table.get("partitions", [])]


# -- OS images --------------------------------------------------------------------------

@dataclass(frozen=True)
class OsImage:
    """A cached OS image in the contract's three formats. ``sha256`` and ``size`` are
    the raw bytes' (what an install request names); the root partition lies at
    ``root_start`` for ``root_size`` bytes."""

    suite: str
    raw: Path
    gzip: Path
    zstd: Path
    sha256: str
    size: int
    root_start: int
    root_size: int

    def file(self, image_format: str) -> Path:
        """The file of a request's ``format``: "raw", "gzip" or "zstd"."""
        files = {"raw": self.raw, "gzip": self.gzip, "zstd": self.zstd}
        if image_format not in files:
            raise ValueError(f"no image format {image_format!r}: one of {sorted(files)}")
        return files[image_format]


def os_image(suite: str = "bookworm", size: int = 320 * MIB, *,
             without: tuple[str, ...] = ()) -> OsImage:
    """The cached image of a stock ``suite`` machine on a disk of ``size`` bytes (a
    multiple of 1 MiB), built if missing; ``ImageTooSmall`` where it cannot fit.
    ``without``: absolute paths of files left out of its root filesystem (an image
    whose system never starts sshd: ``("/usr/sbin/sshd",)``)."""
    if size % MIB or size < 4 * MIB:
        raise ValueError(f"an OS image's size is a multiple of 1 MiB, at least 4: {size}")
    recipe = f"{RECIPE} rootfs={minimal_systems.RECIPE} {suite} {size}"
    if without:
        recipe += f" without={','.join(without)}"
    key = hashlib.sha256(recipe.encode()).hexdigest()[:12]
    final = IMAGES / f"{suite}-{size // MIB}M{'-lacking' if without else ''}-{key}"
    if (final / METADATA).exists():
        return _load(final)
    IMAGES.mkdir(parents=True, exist_ok=True)
    with _locked(IMAGES / f".{final.name}.lock"):
        if (final / METADATA).exists():  # another process built it while we waited
            return _load(final)
        for stale in IMAGES.glob(f".{final.name}.building-*"):  # from builders killed
            shutil.rmtree(stale, ignore_errors=True)
        building = IMAGES / f".{final.name}.building-{os.getpid()}"
        try:
            _build(building, suite, size, recipe, without)
            building.rename(final)
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return _load(final)


def _build(directory: Path, suite: str, size: int, recipe: str,
           without: tuple[str, ...] = ()) -> None:
    """Every file of the image into ``directory``, the metadata last."""
    root = minimal_systems.rootfs(suite)
    root_size = size - ROOT_START - MIB
    _check_fits(root, root_size)
    directory.mkdir()
    raw, part = directory / "disk.raw", directory / "root.ext4"
    with raw.open("xb") as file:
        file.truncate(size)
    _run(["sfdisk", "--quiet", "--no-reread", "--no-tell-kernel", str(raw)],
         stdin=f"label: gpt\nstart={ROOT_START // SECTOR}, size={root_size // SECTOR}, "
               f"type={LINUX_FILESYSTEM}, name={ROOT_NAME}\n")
    with part.open("xb") as file:
        file.truncate(root_size)
    try:
        _run(["mke2fs", "-q", "-F", "-t", "ext4", "-L", ROOT_NAME, "-d", str(root), str(part)])
    except RuntimeError as error:
        if "Could not allocate block" in str(error) or "No space left" in str(error):
            raise ImageTooSmall(f"{suite}'s root filesystem does not fit in the "
                                f"{root_size // MIB} MiB root partition of a "
                                f"{size // MIB} MiB image: ask for a bigger size") from error
        raise
    for path in without:  # debugfs edits the filesystem image in place, nothing mounted
        _run(["debugfs", "-w", "-R", f"rm {path}", str(part)])
        # debugfs exits 0 whatever its command did: the file must now be gone.
        stat = subprocess.run(["debugfs", "-R", f"stat {path}", str(part)],
                              capture_output=True, text=True, timeout=60, check=False)
        if "File not found" not in stat.stderr:
            raise RuntimeError(f"{path} is still in the image's root filesystem")
    _run(["dd", f"if={part}", f"of={raw}", "bs=1M", f"seek={ROOT_START // MIB}",
          "conv=notrunc,sparse", "status=none"])
    part.unlink()
    with (directory / "disk.raw.gz").open("xb") as gz:
        _run(["gzip", "-1", "-c", str(raw)], stdout=gz)
    _run(["zstd", "-1", "-T0", "-q", str(raw), "-o", str(directory / "disk.raw.zst")])
    metadata = {"recipe": recipe, "suite": suite, "sha256": sha256_of(raw), "size": size,
                "root_start": ROOT_START, "root_size": root_size}
    (directory / METADATA).write_text(json.dumps(metadata, indent=1) + "\n")


def _check_fits(root: Path, root_size: int) -> None:
    """Refuse early the sizes that surely cannot hold ``root``'s files (mke2fs's own
    failure, later, catches those short only by the filesystem's overhead)."""
    used = sum(os.lstat(Path(top) / name).st_blocks * 512
               for top, dirs, files in os.walk(root) for name in (*dirs, *files))
    if used >= root_size:
        raise ImageTooSmall(f"{root.name} holds {used // MIB} MiB; the root partition "
                            f"would have {root_size // MIB} MiB: ask for a bigger size")


def _load(directory: Path) -> OsImage:
    metadata = json.loads((directory / METADATA).read_text())
    return OsImage(suite=metadata["suite"], raw=directory / "disk.raw",
                   gzip=directory / "disk.raw.gz", zstd=directory / "disk.raw.zst",
                   sha256=metadata["sha256"], size=metadata["size"],
                   root_start=metadata["root_start"], root_size=metadata["root_size"])


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Exclusive hold of ``path``'s flock, waited for at most ``LOCK_TIMEOUT``."""
    with path.open("a") as file:
        deadline = time.monotonic() + LOCK_TIMEOUT
        while True:
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{path} held for over {LOCK_TIMEOUT:.0f} s") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


def sha256_of(path: Path | str) -> str:
    """The sha256 of a file's bytes (or a device's), read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(MIB):
            digest.update(block)
    return digest.hexdigest()


def _run(command: list[str], *, stdin: str | None = None, stdout: Any = None,
         timeout: float = BUILD_TIMEOUT) -> str:
    """``command``'s output; a failure raises with the command and its last lines."""
    done = subprocess.run(command, input=stdin.encode() if stdin is not None else b"",
                          stdout=stdout if stdout is not None else subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=timeout, check=False)
    if done.returncode != 0:
        tail = (done.stderr or b"").decode(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"{shlex.join(command)} failed ({done.returncode}): {tail}")
    return (done.stdout or b"").decode(errors="replace")
