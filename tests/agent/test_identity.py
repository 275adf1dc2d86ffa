"""The installed system's identity (``shepherd.agent.identity``): the root partition found
from the image's GPT, the host key, authorized keys, hostname and marker written into
its ext4 without mounting it, and every refusal with its one-line cause.

Partition tables are made by ``sfdisk`` (util-linux), an implementation independent of
the parser under test, and corrupted by hand. The written files are checked by the
kernel's own ext4 (a read-only mount of the partition by offset, without the journal)
and by ``e2fsck``, not by the ``debugfs`` the writer used. The GPT and filesystem
checks and the request's validation run on small files, without root; the writes run
on loop devices holding the stock OS image (``tests.support.disk_images``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from shepherd.agent import agent, identity, installer
from shepherd.agent.identity import RootPartition
from tests.support.disk_images import (
    LINUX_FILESYSTEM,
    MIB,
    OsImage,
    attached,
    detach,
    os_image,
    require_disks,
    sha256_of,
)
from tests.support.minimal_systems import require_minimal_systems

X86_64_ROOT = "4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709"
AARCH64_ROOT = "B921B045-1DF0-41C3-AF44-4C6F280D3FAE"
SECTOR = 512
TOOLS = ("sfdisk", "mke2fs", "debugfs")
MARKER = "/etc/shepherd/installation.json"


@pytest.fixture(autouse=True)
def tools() -> None:
    for tool in TOOLS:
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool} (Debian packages fdisk and e2fsprogs)")


def new_host_key() -> tuple[str, str]:
    """A fresh Ed25519 key: its public line and its OpenSSH private key."""
    key = ed25519.Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption()).decode()
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                           serialization.PublicFormat.OpenSSH).decode()
    return public, private


PUBLIC, PRIVATE = new_host_key()
FLEET_KEY = new_host_key()[0] + " shepherd-fleet"


def an_identity(**changes: Any) -> dict[str, Any]:
    document: dict[str, Any] = {
        "hostname": "node-7.rack1.example",
        "authorized_keys": [FLEET_KEY, "from=\"10.0.0.0/8\" " + new_host_key()[0]],
        "host_key": {"public": PUBLIC, "private_openssh": PRIVATE},
        "marker": {"generation": 4, "image": "debian-12", "sha256": "ab" * 32,
                   "machine_id": "6f1c2d4e-0000-4000-8000-000000000001"}}
    document.update(changes)
    return document


def secret_lines() -> list[str]:
    """The private key's base64 lines: none may show up anywhere but in the file."""
    return [line for line in PRIVATE.splitlines() if "-----" not in line]


def assert_no_secret(text: str) -> None:
    assert not [line for line in secret_lines() if line in text], "the private key leaked"


# -- disks made of files ---------------------------------------------------------------


def gpt(path: Path, *parts: tuple[int, int, str, str], size: int = 16 * MIB) -> Path:
    """A sparse disk image of ``size`` bytes with a GPT of ``parts`` (start and size in
    bytes, type GUID, name), written by sfdisk."""
    with path.open("xb") as handle:
        handle.truncate(size)
    script = "label: gpt\n" + "".join(
        f"start={start // SECTOR}, size={length // SECTOR}, type={kind}, name={name}\n"
        for start, length, kind, name in parts)
    subprocess.run(["sfdisk", "--quiet", "--no-reread", "--no-tell-kernel", str(path)],
                   input=script, text=True, check=True, capture_output=True, timeout=30)
    return path


def ext4(path: Path, size: int, files: dict[str, str], *, kind: str = "ext4") -> Path:
    """A filesystem of ``size`` bytes holding ``files`` (path -> text), by mke2fs -d."""
    tree = path.with_suffix(".tree")
    for name, text in files.items():
        file = tree / name.lstrip("/")
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(text)
    tree.mkdir(exist_ok=True)
    with path.open("xb") as handle:
        handle.truncate(size)
    subprocess.run(["mke2fs", "-q", "-F", "-t", kind, "-L", "root", "-d", str(tree), str(path)],
                   check=True, capture_output=True, timeout=60)
    shutil.rmtree(tree)
    return path


#: What an image builder leaves in a small root: its own host keys, a hostname.
STOCK_FILES = {"/etc/hostname": "builder\n", "/etc/ssh/sshd_config": "# stock\n",
               "/etc/ssh/ssh_host_rsa_key": "rsa\n", "/etc/ssh/ssh_host_rsa_key.pub": "rsa\n",
               "/etc/ssh/ssh_host_ecdsa_key": "ecdsa\n",
               "/etc/ssh/ssh_host_ed25519_key": "old\n", "/root/.profile": "# root\n"}


def small_os(path: Path, files: dict[str, str] | None = None, size: int = 8 * MIB) -> Path:
    """A small image as an operator would serve one: GPT, an ext4 named "root" at 1 MiB
    holding ``files`` (default: ``STOCK_FILES``)."""
    root_size = size - 2 * MIB
    gpt(path, (MIB, root_size, LINUX_FILESYSTEM, "root"), size=size)
    part = ext4(path.with_suffix(".part"), root_size, STOCK_FILES if files is None else files)
    with path.open("r+b") as disk, part.open("rb") as source:
        disk.seek(MIB)
        shutil.copyfileobj(source, disk)
    part.unlink()
    return path


def flip(path: Path, offset: int, bits: int = 0xFF) -> None:
    """Flip ``bits`` of the byte at ``offset``."""
    with path.open("r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ bits]))


def failure(call: Any, *args: Any, **kwargs: Any) -> installer.Failure:
    """The identity Failure ``call`` raises; its cause is one line without the key."""
    with pytest.raises(installer.Failure) as raised:
        call(*args, **kwargs)
    assert raised.value.kind == "identity"
    cause = raised.value.cause
    assert cause.startswith("identity: ") and "\n" not in cause and str(raised.value) == cause
    assert_no_secret(cause)
    return raised.value


def debugfs_cat(image: Path, offset: int, path: str) -> bytes:
    return subprocess.run(["debugfs", "-R", f"cat {path}", f"{image}?offset={offset}"],
                          capture_output=True, check=True, timeout=30).stdout


# -- the partition table ----------------------------------------------------------------


def test_the_partition_named_root_is_found(tmp_path):
    disk = gpt(tmp_path / "disk", (MIB, 2 * MIB, LINUX_FILESYSTEM, "data"),
               (3 * MIB, 4 * MIB, LINUX_FILESYSTEM, "root"))
    assert identity.find_root(str(disk)) == RootPartition(
        2, "root", LINUX_FILESYSTEM, 3 * MIB, 4 * MIB)


@pytest.mark.parametrize("root_type", [X86_64_ROOT, AARCH64_ROOT])
def test_a_partition_of_a_root_type_is_found_without_the_name(tmp_path, root_type):
    disk = gpt(tmp_path / "disk", (MIB, 2 * MIB, LINUX_FILESYSTEM, "data"),
               (3 * MIB, 2 * MIB, root_type, "system"))
    with disk.open("rb") as handle:
        assert identity.find_root(handle.fileno(), SECTOR) == RootPartition(
            2, "system", root_type, 3 * MIB, 2 * MIB)


def test_the_name_wins_over_the_type(tmp_path):
    disk = gpt(tmp_path / "disk", (MIB, 2 * MIB, X86_64_ROOT, "system"),
               (3 * MIB, 2 * MIB, LINUX_FILESYSTEM, "root"))
    assert identity.find_root(str(disk)).number == 2


def test_a_block_size_the_table_was_not_written_for_falls_back_to_512(tmp_path):
    disk = gpt(tmp_path / "disk", (MIB, 2 * MIB, LINUX_FILESYSTEM, "root"))
    with disk.open("rb") as handle:
        assert identity.find_root(handle.fileno(), 4096).offset == MIB


@pytest.mark.parametrize(("parts", "cause"), [
    ([(MIB, MIB, LINUX_FILESYSTEM, "data")],
     "identity: no root partition: the image's GPT has no partition named 'root' or typed"
     " Linux root"),
    ([(MIB, MIB, LINUX_FILESYSTEM, "root"), (2 * MIB, MIB, LINUX_FILESYSTEM, "root")],
     "identity: ambiguous root partition: the image's GPT has 2 partitions named 'root':"
     " (1, 'root'), (2, 'root')"),
    ([(MIB, MIB, X86_64_ROOT, "a"), (2 * MIB, MIB, AARCH64_ROOT, "b")],
     "identity: ambiguous root partition: the image's GPT has 2 partitions typed Linux"
     " root: (1, 'a'), (2, 'b')"),
])
def test_no_root_or_two_are_refused(tmp_path, parts, cause):
    disk = gpt(tmp_path / "disk", *parts)
    assert failure(identity.find_root, str(disk)).cause == cause


def test_a_corrupt_header_or_entry_array_is_refused(tmp_path):
    disk = gpt(tmp_path / "disk", (MIB, MIB, LINUX_FILESYSTEM, "root"))
    flip(disk, SECTOR + 60)  # in the header's disk GUID
    assert failure(identity.find_root, str(disk)).cause == (
        "identity: the GPT header's CRC32 does not match: the partition table is corrupt")
    disk = gpt(tmp_path / "disk2", (MIB, MIB, LINUX_FILESYSTEM, "root"))
    flip(disk, 2 * SECTOR + 56)  # the first entry's name
    assert "entries' CRC32 does not match" in failure(identity.find_root, str(disk)).cause


def test_a_disk_without_gpt_is_refused(tmp_path):
    disk = tmp_path / "blank"
    disk.write_bytes(bytes(MIB))
    cause = failure(identity.find_root, str(disk)).cause
    assert cause.startswith("identity: no GPT: the image has no 'EFI PART' header at LBA 1")


def test_a_root_partition_past_the_disks_end_is_refused(tmp_path):
    disk = gpt(tmp_path / "disk", (MIB, 8 * MIB, LINUX_FILESYSTEM, "root"))
    os.truncate(disk, 4 * MIB)  # an image cut short
    assert failure(identity.find_root, str(disk)).cause == (
        "identity: the root partition (1, 'root') lies outside the disk")


# -- the filesystem ---------------------------------------------------------------------


def whole(path: Path) -> RootPartition:
    return RootPartition(1, "root", LINUX_FILESYSTEM, 0, path.stat().st_size)


@pytest.mark.parametrize("kind", ["ext2", "ext3", "ext4"])
def test_the_filesystem_kind_is_read_from_the_superblock(tmp_path, kind):
    part = ext4(tmp_path / "part", 4 * MIB, {}, kind=kind)
    with part.open("rb") as handle:
        assert identity.filesystem(handle.fileno(), whole(part)) == kind


def test_what_debugfs_must_not_write_is_refused(tmp_path):
    zeros = tmp_path / "zeros"
    zeros.write_bytes(bytes(2 * MIB))
    part = ext4(tmp_path / "part", 4 * MIB, {})
    with zeros.open("rb") as handle:
        assert failure(identity.filesystem, handle.fileno(), whole(zeros)).cause == (
            "identity: the root partition (1, 'root') holds no ext2/3/4 filesystem")
    with part.open("rb") as handle:
        smaller = whole(part)._replace(size=2 * MIB)
        assert "filesystem is larger than the partition" in failure(
            identity.filesystem, handle.fileno(), smaller).cause
    flip(part, 1024 + 96, identity.INCOMPAT_RECOVER)  # in s_feature_incompat
    with part.open("rb") as handle:
        assert "journal needs recovery" in failure(
            identity.filesystem, handle.fileno(), whole(part)).cause


# -- the request ------------------------------------------------------------------------


def test_a_good_identity_passes():
    assert identity.problem(an_identity()) is None


@pytest.mark.parametrize(("change", "field"), [
    ({"hostname": "-bad-"}, "identity.hostname"),
    ({"hostname": "a" * 64}, "identity.hostname"),
    ({"hostname": ".".join(["a" * 63] * 4)}, "identity.hostname"),  # 255 characters
    ({"authorized_keys": []}, "identity.authorized_keys"),
    ({"authorized_keys": [FLEET_KEY + "\nssh-ed25519 AAAAinjected"]},
     "identity.authorized_keys[0]"),
    ({"authorized_keys": ["not a key"]}, "identity.authorized_keys[0]"),
    ({"host_key": {"public": "ssh-rsa AAAAB3NzaC1yc2E=", "private_openssh": PRIVATE}},
     "identity.host_key.public"),
    ({"host_key": {"public": PUBLIC, "private_openssh": "-----BEGIN RSA PRIVATE KEY-----"}},
     "identity.host_key.private_openssh"),
    ({"host_key": {"public": new_host_key()[0], "private_openssh": PRIVATE}},
     "identity.host_key.private_openssh is not the private half"),
    ({"host_key": PRIVATE}, "identity.host_key must be an object"),
    ({"marker": {"generation": "4", "image": "i", "sha256": "s", "machine_id": "m"}},
     "identity.marker.generation"),
    ({"marker": {"generation": 4, "image": "i", "sha256": "s"}}, "identity.marker.machine_id"),
    ({"marker": {"generation": 4, "image": "i" * 5000, "sha256": "s", "machine_id": "m"}},
     "identity.marker must be at most 4096 bytes"),
    ({"marker": {"generation": 4, "image": "i", "sha256": "s", "machine_id": "m",
                 "x": float("nan")}}, "identity.marker must be plain JSON"),
])
def test_a_bad_field_is_named_and_no_key_is_quoted(change, field):
    why = identity.problem(an_identity(**change))
    assert why is not None and field in why, why
    assert_no_secret(why)


def test_an_encrypted_private_key_is_refused():
    key = ed25519.Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
        serialization.BestAvailableEncryption(b"passphrase")).decode()
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                           serialization.PublicFormat.OpenSSH).decode()
    why = identity.problem(an_identity(host_key={"public": public, "private_openssh": private}))
    assert why == ("identity.host_key.private_openssh must not be encrypted (sshd cannot ask"
                   " for a passphrase)")


def test_the_agent_logs_requests_without_the_private_key():
    request: dict[str, Any] = {"kind": "image", "authorization": "token",
                               "identity": an_identity()}
    shown = agent.redacted(request)
    assert shown["authorization"] == "(hidden)"
    assert shown["identity"]["host_key"] == {"public": PUBLIC, "private_openssh": "(hidden)"}
    assert shown["identity"]["hostname"] == "node-7.rack1.example"
    assert_no_secret(json.dumps(shown))
    assert request["identity"]["host_key"]["private_openssh"] == PRIVATE  # not changed
    for odd in (PRIVATE, {"host_key": PRIVATE}, [PRIVATE]):
        assert_no_secret(json.dumps(agent.redacted({"kind": "image", "identity": odd})))


# -- writing, on files: what debugfs's exit status would not tell -------------------------


def test_missing_directories_are_made_and_a_directory_in_the_way_is_refused(tmp_path):
    disk = small_os(tmp_path / "bare", {"/etc/hostname": "builder\n"})  # no /root, no ssh
    report = identity.write_identity(str(disk), an_identity())
    assert report["removed"] == [] and report["read_back"] is True
    assert debugfs_cat(disk, MIB, "/root/.ssh/authorized_keys").startswith(FLEET_KEY.encode())
    assert debugfs_cat(disk, MIB, "/etc/ssh/ssh_host_ed25519_key.pub") == (PUBLIC + "\n").encode()
    blocked = small_os(tmp_path / "blocked", {"/etc/hostname/x": "a directory\n"})
    before = sha256_of(blocked)
    assert failure(identity.write_identity, str(blocked), an_identity()).cause == (
        "identity: /etc/hostname in the image is a directory, not a file")
    assert sha256_of(blocked) == before


def test_a_file_that_reads_back_otherwise_fails(tmp_path):
    """A debugfs that says nothing and exits 0, but whose hostname landed otherwise."""
    disk = small_os(tmp_path / "disk")
    tampering = tmp_path / "debugfs"
    tampering.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = -w ]; then\n'
        "  local=$(sed -n 's/^write \\([^ ]*\\) hostname$/\\1/p' \"$3\")\n"
        '  echo tampered > "$local"\n'
        "fi\n"
        f'exec {shutil.which("debugfs")} "$@"\n')
    tampering.chmod(0o755)
    cause = failure(identity.write_identity, str(disk), an_identity(),
                    debugfs=str(tampering)).cause
    assert cause == "identity: /etc/hostname read back differs from what was written"


def test_the_private_directory_is_removed_whatever_happens(tmp_path, monkeypatch):
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    disk = small_os(tmp_path / "disk")
    identity.write_identity(str(disk), an_identity())
    broken = tmp_path / "broken-debugfs"
    broken.write_text("#!/bin/sh\nexit 0\n")  # writes nothing: the read-back fails
    broken.chmod(0o755)
    failure(identity.write_identity, str(disk), an_identity(), debugfs=str(broken))
    assert list((tmp_path / "tmp").iterdir()) == []


# -- writing, on loop devices holding the stock OS image --------------------------------


@pytest.fixture(scope="module")
def image() -> OsImage:
    require_disks()
    require_minimal_systems()
    return os_image()


@pytest.fixture
def image_disk(image: OsImage, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A loop device holding a copy of the OS image (a disk it was installed on)."""
    copy = tmp_path / "disk.raw"
    subprocess.run(["cp", "--sparse=always", str(image.raw), str(copy)], check=True,
                   timeout=120)
    with attached(copy) as device:
        yield device, copy


@contextlib.contextmanager
def mounted_root(image: OsImage, copy: Path, where: Path) -> Iterator[Path]:
    """The root partition, read-only and without replaying the journal, as the kernel's
    ext4 reads it."""
    with attached(copy, offset=image.root_start, sizelimit=image.root_size,
                  read_only=True) as part:
        check = subprocess.run(["e2fsck", "-fn", part], capture_output=True, text=True,
                               timeout=120)
        assert check.returncode == 0, check.stdout + check.stderr
        where.mkdir()
        subprocess.run(["mount", "-o", "ro,noload", part, str(where)], check=True, timeout=30)
        try:
            yield where
        finally:
            subprocess.run(["umount", str(where)], check=True, timeout=30)


def mode_and_owner(path: Path) -> tuple[int, int, int]:
    info = path.lstat()
    return info.st_mode, info.st_uid, info.st_gid


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_identity_lands_in_the_installed_root(image, image_disk, tmp_path):
    device, copy = image_disk
    root = identity.find_root(device)
    assert root == RootPartition(1, "root", LINUX_FILESYSTEM, image.root_start, image.root_size)
    wanted = an_identity()
    report = identity.write_identity(device, wanted)
    assert report == {
        "root_partition": root._asdict(), "filesystem": "ext4",
        "files": ["/etc/ssh/ssh_host_ed25519_key", "/etc/ssh/ssh_host_ed25519_key.pub",
                  "/root/.ssh/authorized_keys", "/etc/hostname", MARKER],
        "removed": ["/etc/ssh/ssh_host_ecdsa_key", "/etc/ssh/ssh_host_ecdsa_key.pub",
                    "/etc/ssh/ssh_host_rsa_key", "/etc/ssh/ssh_host_rsa_key.pub"],
        "read_back": True}
    assert_no_secret(json.dumps(report))
    with mounted_root(image, copy, tmp_path / "root") as mounted:
        etc = mounted / "etc"
        assert (etc / "ssh/ssh_host_ed25519_key").read_text() == PRIVATE
        assert mode_and_owner(etc / "ssh/ssh_host_ed25519_key") == (stat.S_IFREG | 0o600, 0, 0)
        assert (etc / "ssh/ssh_host_ed25519_key.pub").read_text() == PUBLIC + "\n"
        assert mode_and_owner(etc / "ssh/ssh_host_ed25519_key.pub") == (
            stat.S_IFREG | 0o644, 0, 0)
        assert sorted(p.name for p in (etc / "ssh").glob("ssh_host_*")) == [
            "ssh_host_ed25519_key", "ssh_host_ed25519_key.pub"]
        assert (etc / "ssh/sshd_config").exists()  # the rest of the image is untouched
        ssh = mounted / "root/.ssh"
        assert mode_and_owner(ssh) == (stat.S_IFDIR | 0o700, 0, 0)
        assert (ssh / "authorized_keys").read_text().splitlines() == wanted["authorized_keys"]
        assert mode_and_owner(ssh / "authorized_keys") == (stat.S_IFREG | 0o600, 0, 0)
        assert (etc / "hostname").read_text() == "node-7.rack1.example\n"
        assert mode_and_owner(etc / "hostname") == (stat.S_IFREG | 0o644, 0, 0)
        assert mode_and_owner(etc / "shepherd") == (stat.S_IFDIR | 0o755, 0, 0)
        assert json.loads((etc / "shepherd/installation.json").read_text()) == wanted["marker"]
        assert mode_and_owner(etc / "shepherd/installation.json") == (stat.S_IFREG | 0o644, 0, 0)
        # What the installed system's agent will tell Shepherd in its first heartbeat.
        assert agent.read_installation(str(mounted), []) == wanted["marker"]
    with copy.open("rb") as disk, image.raw.open("rb") as original:
        assert disk.read(image.root_start) == original.read(image.root_start)
        end = image.root_start + image.root_size
        disk.seek(end)
        original.seek(end)
        assert disk.read() == original.read(), "bytes past the root partition changed"


def table_only(tmp_path: Path, *parts: tuple[int, int, str, str]) -> Path:
    """A disk holding a partition table and nothing else (zeros)."""
    return gpt(tmp_path / "table.raw", *parts)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize(("make", "debugfs", "cause"), [
    (lambda tmp, image: table_only(tmp, (MIB, 4 * MIB, LINUX_FILESYSTEM, "data")), "debugfs",
     "identity: no root partition: the image's GPT has no partition named 'root' or typed"
     " Linux root"),
    (lambda tmp, image: table_only(tmp, (MIB, 4 * MIB, LINUX_FILESYSTEM, "root"),
                                (5 * MIB, 4 * MIB, X86_64_ROOT, "root")), "debugfs",
     "identity: ambiguous root partition: the image's GPT has 2 partitions named 'root':"
     " (1, 'root'), (2, 'root')"),
    (lambda tmp, image: table_only(tmp, (MIB, 4 * MIB, LINUX_FILESYSTEM, "root")), "debugfs",
     "identity: the root partition (1, 'root') holds no ext2/3/4 filesystem"),
    ("corrupt", "debugfs",
     "identity: the GPT header's CRC32 does not match: the partition table is corrupt"),
    ("image", "/nonexistent/debugfs",
     "identity: debugfs not found: the system running the agent needs e2fsprogs"),
], ids=["no-root", "two-roots", "zero-filled-root", "corrupt-crc", "no-debugfs"])
def test_what_cannot_be_written_leaves_the_disk_unchanged(image, tmp_path, make, debugfs,
                                                          cause):
    if callable(make):
        disk = make(tmp_path, image)
    else:
        disk = tmp_path / "disk.raw"
        subprocess.run(["cp", "--sparse=always", str(image.raw), str(disk)], check=True,
                       timeout=120)
        if make == "corrupt":
            flip(disk, SECTOR + 60)
    before = sha256_of(disk)
    with attached(disk) as device:
        raised = failure(identity.write_identity, device, an_identity(), debugfs=debugfs)
        assert raised.cause == cause
    assert sha256_of(disk) == before


def test_a_disk_of_4096_byte_sectors_is_read_in_its_blocks(tmp_path):
    require_disks()
    disk = tmp_path / "disk4k"
    with disk.open("xb") as handle:
        handle.truncate(16 * MIB)
    device = subprocess.run(["losetup", "--find", "--show", "--sector-size", "4096", str(disk)],
                            capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    try:
        subprocess.run(["sfdisk", "--quiet", "--no-reread", "--no-tell-kernel", device],
                       input=f"label: gpt\nstart=512, size=1024, type={X86_64_ROOT}, name=sys\n",
                       text=True, check=True, capture_output=True, timeout=30)
        assert identity.find_root(device) == RootPartition(
            1, "sys", X86_64_ROOT, 512 * 4096, 1024 * 4096)
    finally:
        detach(device)
