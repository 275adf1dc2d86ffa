"""The OS-installation tests' disks, on real parts: loop devices, and the OS image built
from a stock machine's root filesystem (``tests.support.disk_images``).

* A loop disk is a real block device of the asked size, and gone afterwards (detached,
  its file removed), also when the test inside fails.
* The image is what an operator serves: GPT, one "Linux filesystem" partition named
  root at 1 MiB, a clean ext4 labelled root holding python3 and sshd (read with
  e2fsprogs on a loop device over that partition's bytes, the way later tests reach a
  root they cannot get a partition node for), and gzip and zstd copies that decompress
  to the raw image's recorded sha256.
* A size too small for the system is refused with a clear error, and leaves nothing
  in the cache.

The first run debootstraps bookworm (about a minute) and builds the image (about 15 s);
later runs find both cached.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import disk_images
from tests.support.disk_images import (
    LINUX_FILESYSTEM,
    MIB,
    ImageTooSmall,
    OsImage,
    attached,
    backing_file_path,
    device_size,
    loop_disk,
    os_image,
    partitions,
    require_disks,
    sha256_of,
)
from tests.support.minimal_systems import require_minimal_systems

ROOT = Path(__file__).resolve().parents[2]
#: A first run debootstraps and builds; every step of that is bounded on its own.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def image() -> OsImage:
    require_disks()
    require_minimal_systems()
    return os_image()


@pytest.fixture()
def root_device(image: OsImage) -> Iterator[str]:
    """The image's root partition, read-only, as a loop device of its own."""
    with attached(image.raw, offset=image.root_start, sizelimit=image.root_size,
                  read_only=True) as device:
        yield device


def attached_files() -> str:
    return subprocess.run(["losetup", "--list", "--noheadings", "--output", "BACK-FILE"],
                          capture_output=True, text=True, check=True, timeout=30).stdout


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


# -- loop disks ---------------------------------------------------------------------------

def test_loop_disk_is_a_block_device_of_the_asked_size_and_is_gone_afterwards(
        tmp_path: Path) -> None:
    require_disks()
    path, size = tmp_path / "disk", 48 * MIB
    with loop_disk(path, size) as device:
        assert stat.S_ISBLK(os.stat(device).st_mode)
        assert device_size(device) == size
        assert backing_file_path(device).read_text().strip() == str(path)
        assert str(path) in attached_files()
        block = os.urandom(MIB)
        descriptor = os.open(device, os.O_RDWR)
        try:
            os.pwrite(descriptor, block, 7 * MIB)
            os.fsync(descriptor)
            assert os.pread(descriptor, MIB, 7 * MIB) == block
        finally:
            os.close(descriptor)
        assert path.read_bytes()[7 * MIB:8 * MIB] == block  # the bytes are the file's
    assert str(path) not in attached_files()
    assert not backing_file_path(device).exists()
    assert not path.exists()


def test_loop_disk_is_detached_and_removed_when_the_test_inside_fails(tmp_path: Path) -> None:
    require_disks()
    path = tmp_path / "disk"
    with pytest.raises(KeyError), loop_disk(path, 8 * MIB) as device:
        raise KeyError("the test inside failed")
    assert str(path) not in attached_files()
    assert not backing_file_path(device).exists()
    assert not path.exists()


def test_a_blank_loop_disk_has_no_partitions(tmp_path: Path) -> None:
    require_disks()
    with loop_disk(tmp_path / "disk", 8 * MIB) as device:
        assert partitions(device) == []


# -- the OS image ---------------------------------------------------------------------------

def test_image_has_one_gpt_partition_named_root_at_1_mib(image: OsImage) -> None:
    [root] = partitions(image.raw)
    assert root["label"] == "gpt"
    assert (root["name"], root["type"]) == ("root", LINUX_FILESYSTEM)
    assert (root["start"], root["size"]) == (MIB, image.root_size)
    assert (image.root_start, image.root_start + image.root_size) == (MIB, image.size - MIB)
    with attached(image.raw, read_only=True) as device:  # as a disk reads it, too
        assert [(p["name"], p["start"], p["size"]) for p in partitions(device)] == [
            ("root", MIB, image.root_size)]


def test_root_filesystem_is_a_clean_ext4_labelled_root(root_device: str) -> None:
    checked = run("e2fsck", "-f", "-n", root_device)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    header = run("dumpe2fs", "-h", root_device).stdout
    assert "Filesystem volume name:   root" in header
    assert "has_journal" in header and "extent" in header  # ext4, not ext2


def test_root_filesystem_holds_python3_and_sshd(root_device: str) -> None:
    assert file_type(root_device, "/usr/sbin/sshd") == "regular"
    assert file_type(root_device, "/usr/bin/python3") == "regular"
    assert file_type(root_device, "/usr/bin/no-such-program") == "missing"


def file_type(device: str, path: str) -> str:
    """What ``path`` is on the ext4 at ``device`` ("regular", "directory"...,
    "missing"), following symbolic links, as debugfs reads it: nothing mounted."""
    for _ in range(8):
        shown = run("debugfs", "-R", f"stat {path}", device)
        if "File not found" in shown.stderr:
            return "missing"
        kind = shown.stdout.split("Type: ", 1)[1].split()[0]
        if kind != "symlink":
            return kind
        target = shown.stdout.split('Fast link dest: "', 1)[1].split('"', 1)[0]
        path = target if target.startswith("/") else f"{path.rsplit('/', 1)[0]}/{target}"
    raise AssertionError(f"{path}: too many symbolic links")


@pytest.mark.parametrize("image_format", ["gzip", "zstd"])
def test_compressed_copies_decompress_to_the_raw_image(image: OsImage,
                                                       image_format: str) -> None:
    command = {"gzip": ["gzip", "-dc"], "zstd": ["zstd", "-dcq"]}[image_format]
    compressed = image.file(image_format)
    assert compressed.stat().st_size < image.size / 2
    digest, size = hashlib.sha256(), 0
    with subprocess.Popen([*command, str(compressed)], stdout=subprocess.PIPE) as process:
        assert process.stdout is not None
        while block := process.stdout.read(MIB):
            digest.update(block)
            size += len(block)
        assert process.wait(timeout=120) == 0
    assert (digest.hexdigest(), size) == (image.sha256, image.size)


def test_recorded_sha256_and_size_are_the_raw_files(image: OsImage) -> None:
    assert image.raw.stat().st_size == image.size == 320 * MIB
    assert sha256_of(image.raw) == image.sha256
    assert os_image() == image  # read back from the cache, as a later run does


def test_a_size_too_small_for_the_system_is_refused(image: OsImage) -> None:
    with pytest.raises(ImageTooSmall, match="bigger size"):
        os_image(size=64 * MIB)
    leftovers = [p.name for p in disk_images.IMAGES.iterdir() if "-64M-" in p.name
                 and not p.name.endswith(".lock")]
    assert leftovers == []
