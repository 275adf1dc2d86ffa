"""The agent's image writer on real loop devices, fed by a real HTTP server on 127.0.0.1.

Every disk is a loop device over a sparse file in the test's directory, filled first
with random bytes: what the writer wrote (or did not) is read back from that file,
independently of the writer's own read-back. Serials and WWNs are declared as udev
would, in a ``run_root`` of the test's own (``/run/udev/data/b<major>:<minor>``).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shepherd.agent import installer
from tests.agent.test_identity import an_identity, assert_no_secret, gpt, small_os
from tests.support.disk_images import LINUX_FILESYSTEM
from tests.support.image_server import ImageServer

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("losetup") is None,
    reason="needs root and losetup (loop devices)")

MiB = 1 << 20
#: Not a multiple of 512: the last partial block is written too.
IMAGE_SIZE = 3 * MiB + 777


class Loop:
    """A loop device over a sparse file of random bytes."""

    def __init__(self, backing: Path, size: int) -> None:
        with open(backing, "wb") as handle:
            handle.write(os.urandom(min(size, 8 * MiB)))
            handle.truncate(size)
        self.backing = backing
        self.path = subprocess.run(["losetup", "-f", "--show", str(backing)], check=True,
                                   capture_output=True, text=True).stdout.strip()
        self.name = os.path.basename(self.path)
        self.dev = Path(f"/sys/block/{self.name}/dev").read_text().strip()

    def head(self, size: int) -> bytes:
        with open(self.backing, "rb") as handle:
            return handle.read(size)

    def detach(self) -> None:
        subprocess.run(["losetup", "-d", self.path], check=False)


@pytest.fixture
def loops(tmp_path: Path) -> Iterator[Any]:
    made: list[Loop] = []

    def make(size: int = 8 * MiB) -> Loop:
        made.append(Loop(tmp_path / f"disk{len(made)}.img", size))
        return made[-1]

    try:
        yield make
    finally:
        for loop in made:
            loop.detach()


@pytest.fixture
def run_root(tmp_path: Path) -> Path:
    (tmp_path / "run/run/udev/data").mkdir(parents=True)
    return tmp_path / "run"


def declare(run_root: Path, loop: Loop, serial: str = "", wwn: str = "") -> None:
    """What udev would record for the disk: its serial and WWN."""
    lines = [f"E:ID_SERIAL_SHORT={serial}"] if serial else []
    lines += [f"E:ID_WWN={wwn}"] if wwn else []
    (run_root / f"run/udev/data/b{loop.dev}").write_text("\n".join(lines) + "\n")


@pytest.fixture
def serve() -> Iterator[Any]:
    servers: list[ImageServer] = []

    def start(body: bytes | Path) -> ImageServer:
        servers.append(ImageServer(body))
        return servers[-1]

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


def image_request(raw: bytes, url: str, disk: str, *, form: str = "raw",
                  sha256: str | None = None, retries: int = 2, stall: float = 5.0,
                  deadline: float = 60.0, authorization: str | None = None) -> dict[str, Any]:
    return {"kind": "image",
            "image": {"name": "test", "url": url, "format": form, "size": len(raw),
                      "sha256": sha256 or hashlib.sha256(raw).hexdigest()},
            "disk": disk, "authorization": authorization,
            "machine_id": "6f1c2d4e-0000-4000-8000-000000000001",
            "limits": {"retries": retries, "stall_seconds": stall,
                       "deadline_seconds": deadline}}


class Run:
    """One install, with its progress reports."""

    def __init__(self, request: dict[str, Any], run_root: Path,
                 cancel_when: str | None = None) -> None:
        self.progress: list[dict[str, Any]] = []
        self.cancelled = threading.Event()
        self.cancel_when = cancel_when
        started = time.monotonic()
        self.result = installer.install(request, progress=self.report,
                                        cancelled=self.cancelled, run_root=str(run_root))
        self.seconds = time.monotonic() - started

    def report(self, progress: dict[str, Any]) -> None:
        self.progress.append(progress)
        if progress["phase"] == self.cancel_when:
            self.cancelled.set()

    @property
    def phases(self) -> list[str]:
        return list(dict.fromkeys(p["phase"] for p in self.progress))


def assert_written(run: Run, loop: Loop, raw: bytes, after: bytes) -> None:
    """The install succeeded, the disk holds the image, and nothing past it changed."""
    result = run.result
    assert result["status"] == "ok", result
    expected = hashlib.sha256(raw).hexdigest()
    assert result["written_sha256"] == result["read_back_sha256"] == expected
    assert result["bytes"] == len(raw)
    assert result["disk"] == loop.path
    assert result["cause"] is None and result["cause_kind"] is None
    disk = loop.head(len(raw) + len(after))
    assert disk[:len(raw)] == raw
    assert disk[len(raw):] == after, "bytes past the image's end were written"
    assert set(result["durations"]) == {"write", "flush", "read_back"}


def assert_unchanged(run: Run, loop: Loop, before: bytes, kind: str) -> None:
    result = run.result
    assert (result["status"], result["cause_kind"]) == ("refused", kind), result
    assert result["cause"].endswith("nothing was written"), result["cause"]
    assert result["bytes"] == 0 and result["written_sha256"] is None
    assert loop.head(len(before)) == before


# -- writing -------------------------------------------------------------------------


def test_a_raw_image_lands_on_the_disk_by_serial(loops, run_root, serve):
    raw = os.urandom(IMAGE_SIZE)
    loop = loops()
    declare(run_root, loop, serial="SERIAL-ONE")
    after = loop.head(IMAGE_SIZE + 4096)[IMAGE_SIZE:]
    server = serve(raw)
    run = Run(image_request(raw, server.url, "serial=SERIAL-ONE"), run_root)
    assert_written(run, loop, raw, after)
    assert run.result["retries"] == 0
    assert run.phases == ["fetching", "writing", "flushing", "verifying"]
    assert {"bytes_done", "bytes_total", "rate", "eta_seconds"} <= set(run.progress[-1])


def test_a_gzip_image_is_decompressed_by_wwn(loops, run_root, serve):
    raw = os.urandom(IMAGE_SIZE)
    loop = loops()
    declare(run_root, loop, wwn="0x5000C500A1B2C3D4")
    after = loop.head(IMAGE_SIZE + 4096)[IMAGE_SIZE:]
    # Two members, as concatenated gzip files are: both are part of the image.
    server = serve(gzip.compress(raw[:MiB]) + gzip.compress(raw[MiB:]))
    request = image_request(raw, server.url, "wwn=naa.5000c500a1b2c3d4", form="gzip")
    assert_written(Run(request, run_root), loop, raw, after)


@pytest.mark.skipif(shutil.which("zstd") is None, reason="needs the zstd program")
def test_a_zstd_image_is_decompressed_by_the_zstd_program(loops, run_root, serve):
    raw = os.urandom(IMAGE_SIZE)
    loop = loops()
    after = loop.head(IMAGE_SIZE + 4096)[IMAGE_SIZE:]
    packed = subprocess.run(["zstd", "-q", "-c", "-1"], input=raw, check=True,
                            capture_output=True).stdout
    server = serve(packed)
    request = image_request(raw, server.url, f"device={loop.path}", form="zstd")
    assert_written(Run(request, run_root), loop, raw, after)


def test_a_wrong_digest_fails_and_says_the_disk_is_undefined(loops, run_root, serve):
    raw = os.urandom(IMAGE_SIZE)
    loop = loops()
    server = serve(raw)
    request = image_request(raw, server.url, f"device={loop.path}", sha256="0" * 64)
    result = Run(request, run_root).result
    assert (result["status"], result["cause_kind"]) == ("failed", "digest"), result
    assert result["cause"].endswith("the disk's contents are now undefined")
    assert result["written_sha256"] == hashlib.sha256(raw).hexdigest()
    assert loop.head(len(raw)) == raw  # written all the same: the digest is known at the end


def test_a_udev_style_link_names_the_disk(loops, run_root, serve, tmp_path):
    """Operators use /dev/disk/by-*; any link whose target is a whole disk is accepted."""
    raw = os.urandom(IMAGE_SIZE)
    loop = loops()
    after = loop.head(IMAGE_SIZE + 4096)[IMAGE_SIZE:]
    link = tmp_path / "by-id" / "wwn-0xtest"
    link.parent.mkdir()
    link.symlink_to(loop.path)
    server = serve(raw)
    assert_written(Run(image_request(raw, server.url, str(link)), run_root), loop, raw, after)


def test_a_server_without_range_support_serves_the_image(loops, run_root, tmp_path):
    """Python's own ``http.server``, as an operator might serve an image from anywhere."""
    raw = os.urandom(IMAGE_SIZE)
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "disk.img").write_bytes(raw)
    loop = loops()
    after = loop.head(IMAGE_SIZE + 4096)[IMAGE_SIZE:]
    server = subprocess.Popen(
        [sys.executable, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1",
         "--directory", str(tmp_path / "www")], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = re.search(r"port (\d+)", server.stdout.readline())
        assert port, "http.server did not say its port"
        url = f"http://127.0.0.1:{port.group(1)}/disk.img"
        run = Run(image_request(raw, url, f"device={loop.path}"), run_root)
    finally:
        server.kill()
        server.wait()
    assert_written(run, loop, raw, after)


@pytest.mark.skipif(shutil.which("debugfs") is None or shutil.which("sfdisk") is None,
                    reason="needs debugfs and sfdisk (e2fsprogs, fdisk)")
def test_an_identity_is_written_into_the_image_once_it_is_verified(loops, run_root, serve,
                                                                    tmp_path):
    raw = small_os(tmp_path / "image.raw").read_bytes()
    loop = loops(16 * MiB)
    request = image_request(raw, serve(raw).url, f"device={loop.path}")
    request["identity"] = an_identity()
    run = Run(request, run_root)
    result = run.result
    assert result["status"] == "ok", result
    assert result["read_back_sha256"] == hashlib.sha256(raw).hexdigest()
    assert run.phases == ["fetching", "writing", "flushing", "verifying", "identity"]
    assert result["identity"]["read_back"] is True
    assert result["identity"]["root_partition"]["offset"] == MiB
    assert set(result["durations"]) == {"write", "flush", "read_back", "identity"}
    assert_no_secret(json.dumps(result))
    hostname = subprocess.run(["debugfs", "-R", "cat /etc/hostname",
                               f"{loop.backing}?offset={MiB}"], capture_output=True,
                              check=True).stdout
    assert hostname == b"node-7.rack1.example\n"


@pytest.mark.skipif(shutil.which("debugfs") is None or shutil.which("sfdisk") is None,
                    reason="needs debugfs and sfdisk (e2fsprogs, fdisk)")
def test_an_identity_that_cannot_be_written_fails_the_verified_install(loops, run_root,
                                                                       serve, tmp_path):
    raw = gpt(tmp_path / "image.raw", (MiB, 2 * MiB, LINUX_FILESYSTEM, "data"),
              size=4 * MiB).read_bytes()
    loop = loops(16 * MiB)
    request = image_request(raw, serve(raw).url, f"device={loop.path}")
    request["identity"] = an_identity()
    result = Run(request, run_root).result
    assert (result["status"], result["cause_kind"]) == ("failed", "identity"), result
    assert result["cause"].startswith("identity: no root partition: ")
    assert result["cause"].endswith("; the image was written and verified, the identity"
                                    " was not")
    assert result["read_back_sha256"] == hashlib.sha256(raw).hexdigest()
    assert loop.head(len(raw)) == raw


# -- the network ---------------------------------------------------------------------


def test_a_cut_stream_resumes_with_range(loops, run_root, serve):
    raw = os.urandom(IMAGE_SIZE)
    loop = loops()
    after = loop.head(IMAGE_SIZE + 4096)[IMAGE_SIZE:]
    server = serve(raw)
    server.cut_after, server.cuts = IMAGE_SIZE // 2, 1
    run = Run(image_request(raw, server.url, f"device={loop.path}"), run_root)
    assert_written(run, loop, raw, after)
    assert run.result["retries"] == 1
    assert [r.get("Range") for r in server.requests] == [None, f"bytes={IMAGE_SIZE // 2}-"]


def test_a_compressed_stream_resumes_mid_stream(loops, run_root, serve):
    raw = os.urandom(IMAGE_SIZE)
    loop = loops()
    after = loop.head(IMAGE_SIZE + 4096)[IMAGE_SIZE:]
    packed = gzip.compress(raw)
    server = serve(packed)
    server.cut_after, server.cuts = len(packed) // 3, 2
    run = Run(image_request(raw, server.url, f"device={loop.path}", form="gzip"), run_root)
    assert_written(run, loop, raw, after)
    assert run.result["retries"] == 2
    assert server.requests[-1]["Range"] == f"bytes={2 * (len(packed) // 3)}-"


def test_a_stream_cut_every_time_fails_after_the_retries(loops, run_root, serve):
    raw = os.urandom(12 * MiB)
    loop = loops(16 * MiB)
    server = serve(raw)
    server.cut_after, server.cuts = 3 * MiB // 2, 100  # 4.5 MiB in all: one buffer written
    result = Run(image_request(raw, server.url, f"device={loop.path}", retries=2),
                 run_root).result
    assert (result["status"], result["cause_kind"]) == ("failed", "fetch"), result
    assert result["retries"] == 2 and len(server.requests) == 3
    assert "gave up after 2 retries" in result["cause"]
    assert result["cause"].endswith("the disk's contents are now undefined")
    assert result["bytes"] < len(raw)


def test_a_server_ignoring_range_makes_it_start_over(loops, run_root, serve):
    raw = os.urandom(IMAGE_SIZE)
    loop = loops()
    after = loop.head(IMAGE_SIZE + 4096)[IMAGE_SIZE:]
    server = serve(raw)
    server.cut_after, server.cuts = IMAGE_SIZE // 2, 1
    server.ignore_range = True
    run = Run(image_request(raw, server.url, f"device={loop.path}"), run_root)
    assert_written(run, loop, raw, after)
    assert run.result["retries"] == 1
    assert server.requests[1]["Range"] == f"bytes={IMAGE_SIZE // 2}-"


@pytest.mark.timeout(30)
def test_a_stalled_server_fails_as_a_stall(loops, run_root, serve):
    raw = os.urandom(IMAGE_SIZE)
    loop = loops()
    server = serve(raw)
    server.stall_after = MiB
    stall, retries = 0.5, 2
    run = Run(image_request(raw, server.url, f"device={loop.path}", stall=stall,
                            retries=retries), run_root)
    result = run.result
    assert (result["status"], result["cause_kind"]) == ("failed", "stall"), result
    assert "no bytes for 0.5 s" in result["cause"]
    assert run.seconds < stall * (retries + 1) + 2.0
    assert result["retries"] == retries


def test_refused_authorization_is_not_retried(loops, run_root, serve):
    raw = os.urandom(IMAGE_SIZE)
    loop = loops()
    before = loop.head(IMAGE_SIZE)
    server = serve(raw)
    server.status = 401
    request = image_request(raw, server.url, f"device={loop.path}", authorization="tok")
    result = Run(request, run_root).result
    assert (result["status"], result["cause_kind"]) == ("failed", "fetch"), result
    assert "401" in result["cause"] and "undefined" not in result["cause"]
    assert result["retries"] == 0 and len(server.requests) == 1
    assert server.requests[0]["Authorization"] == "Bearer tok"
    assert server.requests[0]["X-Shepherd-Machine"] == request["machine_id"]
    assert loop.head(IMAGE_SIZE) == before


def test_a_stream_longer_than_the_image_fails(loops, run_root, serve):
    raw = os.urandom(IMAGE_SIZE)
    loop = loops()
    before = loop.head(IMAGE_SIZE + 4096)
    server = serve(raw + b"more")
    result = Run(image_request(raw, server.url, f"device={loop.path}"), run_root).result
    assert (result["status"], result["cause_kind"]) == ("failed", "fetch"), result
    assert "longer" in result["cause"]
    assert loop.head(IMAGE_SIZE + 4096) == before  # announced: refused before writing
    # A compressed stream says its raw size only at its end: never past the size.
    server = serve(gzip.compress(raw + b"more"))
    result = Run(image_request(raw, server.url, f"device={loop.path}", form="gzip"),
                 run_root).result
    assert (result["status"], result["cause_kind"]) == ("failed", "fetch"), result
    assert "longer" in result["cause"] and result["cause"].endswith("undefined")
    assert loop.head(IMAGE_SIZE + 4096)[IMAGE_SIZE:] == before[IMAGE_SIZE:]


def test_a_cancel_stops_the_write(loops, run_root, serve):
    raw = os.urandom(16 * MiB)
    loop = loops(32 * MiB)
    server = serve(raw)
    run = Run(image_request(raw, server.url, f"device={loop.path}"), run_root,
              cancel_when="writing")
    result = run.result
    assert result["status"] == "canceled", result
    assert result["cause"].endswith("the disk's contents are now undefined")
    assert 0 < result["bytes"] < len(raw)
    assert not [t for t in threading.enumerate() if t.name.startswith("installer-")]


# -- refusals ------------------------------------------------------------------------


def test_a_mounted_disk_is_refused(loops, run_root, serve, tmp_path):
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("needs mkfs.ext4")
    loop = loops()
    subprocess.run(["mkfs.ext4", "-q", "-F", loop.path], check=True)
    mount = tmp_path / "mnt"
    mount.mkdir()
    subprocess.run(["mount", "-o", "ro", loop.path, str(mount)], check=True)
    try:
        before = loop.head(IMAGE_SIZE)
        raw = os.urandom(IMAGE_SIZE)
        run = Run(image_request(raw, serve(raw).url, f"device={loop.path}"), run_root)
        assert_unchanged(run, loop, before, "mounted")
        assert f"{loop.path} holds a mounted filesystem ({mount})" in run.result["cause"]
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_disk_with_active_swap_is_refused(loops, run_root, serve):
    if shutil.which("mkswap") is None or shutil.which("swapon") is None:
        pytest.skip("needs mkswap and swapon")
    loop = loops()
    subprocess.run(["mkswap", "-q", loop.path], check=True, capture_output=True)
    on = subprocess.run(["swapon", loop.path], capture_output=True, text=True)
    if on.returncode != 0:
        pytest.skip(f"swapon refused here: {on.stderr.strip()}")
    try:
        before = loop.head(IMAGE_SIZE)
        raw = os.urandom(IMAGE_SIZE)
        run = Run(image_request(raw, serve(raw).url, f"device={loop.path}"), run_root)
        assert_unchanged(run, loop, before, "swap")
        assert loop.path in run.result["cause"]
    finally:
        subprocess.run(["swapoff", loop.path], check=False)


def test_a_disk_smaller_than_the_image_is_refused(loops, run_root, serve):
    loop = loops(2 * MiB)
    before = loop.head(2 * MiB)
    raw = os.urandom(IMAGE_SIZE)
    run = Run(image_request(raw, serve(raw).url, f"device={loop.path}"), run_root)
    assert_unchanged(run, loop, before, "too_small")
    assert f"{loop.path} has {2 * MiB} bytes" in run.result["cause"]


def test_a_serial_on_two_disks_is_refused(loops, run_root, serve):
    one, two = loops(), loops()
    declare(run_root, one, serial="TWIN")
    declare(run_root, two, serial="TWIN")
    before = one.head(IMAGE_SIZE), two.head(IMAGE_SIZE)
    raw = os.urandom(IMAGE_SIZE)
    run = Run(image_request(raw, serve(raw).url, "serial=TWIN"), run_root)
    assert_unchanged(run, one, before[0], "ambiguous_disk")
    assert two.head(IMAGE_SIZE) == before[1]
    assert one.path in run.result["cause"] and two.path in run.result["cause"]
    assert "serial=TWIN" in run.result["cause"]


def test_a_serial_on_no_disk_is_refused(run_root):
    raw = b"x" * 1024
    result = installer.install(image_request(raw, "http://127.0.0.1:9/x", "serial=NONE"),
                               progress=lambda _: None, cancelled=threading.Event(),
                               run_root=str(run_root))
    assert (result["status"], result["cause_kind"]) == ("refused", "no_disk"), result
    assert "serial=NONE" in result["cause"] and result["disk"] is None


def test_a_bare_device_path_is_refused(loops, run_root, serve):
    loop = loops()
    before = loop.head(IMAGE_SIZE)
    raw = os.urandom(IMAGE_SIZE)
    run = Run(image_request(raw, serve(raw).url, loop.path), run_root)
    assert_unchanged(run, loop, before, "bad_request")
    assert f"device={loop.path}" in run.result["cause"]


def test_a_partition_is_refused_and_its_mount_guards_the_disk(loops, run_root, serve,
                                                              tmp_path):
    """Whole disks only; and a filesystem mounted from a partition guards its disk."""
    if shutil.which("sfdisk") is None or shutil.which("mkfs.ext4") is None:
        pytest.skip("needs sfdisk and mkfs.ext4")
    loop = loops()
    subprocess.run(["sfdisk", "-q", loop.path], input="label: dos\n,4M\n", text=True,
                   check=True, capture_output=True)
    subprocess.run(["losetup", "-d", loop.path], check=True)
    loop.path = subprocess.run(["losetup", "-P", "-f", "--show", str(loop.backing)],
                               check=True, capture_output=True, text=True).stdout.strip()
    subprocess.run(["partx", "-a", loop.path], check=False, capture_output=True)
    partition = Path(f"{loop.path}p1")
    with made_node(partition, Path(f"/sys/class/block/{partition.name}/dev")):
        raw = os.urandom(1024)
        url = serve(raw).url
        run = Run(image_request(raw, url, f"device={partition}"), run_root)
        assert (run.result["status"], run.result["cause_kind"]) == ("refused", "not_a_disk")
        assert "a partition" in run.result["cause"]
        subprocess.run(["mkfs.ext4", "-q", "-F", str(partition)], check=True)
        mount = tmp_path / "mnt"
        mount.mkdir()
        subprocess.run(["mount", "-o", "ro", str(partition), str(mount)], check=True)
        try:
            before = loop.head(IMAGE_SIZE)
            run = Run(image_request(raw, url, f"device={loop.path}"), run_root)
            assert_unchanged(run, loop, before, "mounted")
            assert str(mount) in run.result["cause"]
        finally:
            subprocess.run(["umount", str(mount)], check=False)


@contextlib.contextmanager
def made_node(node: Path, dev: Path) -> Iterator[None]:
    """The partition's device node, made by hand where no udev makes it."""
    for _ in range(50):
        if node.exists() or dev.exists():
            break
        time.sleep(0.05)
    if not dev.exists():
        pytest.skip(f"the kernel shows no partition {node.name}")
    made = not node.exists()
    if made:
        major, minor = map(int, dev.read_text().split(":"))
        os.mknod(node, 0o600 | stat.S_IFBLK, os.makedev(major, minor))
    try:
        yield
    finally:
        if made:
            node.unlink()


@pytest.mark.parametrize(("change", "field"), [
    (lambda r: r.update(kind="script"), "kind"),
    (lambda r: r["image"].update(sha256="abc"), "image.sha256"),
    (lambda r: r["image"].update(size=True), "image.size"),
    (lambda r: r["image"].update(format="xz"), "image.format"),
    (lambda r: r["image"].update(url="ftp://x/y"), "image.url"),
    (lambda r: r["limits"].update(stall_seconds=-1), "limits.stall_seconds"),
    (lambda r: r.update(authorization="a\r\nb"), "authorization"),
    (lambda r: r.update(identity=an_identity(hostname="no_underscores")), "identity.hostname"),
    (lambda r: r.update(identity=[]), "identity must be an object"),
])
def test_a_bad_request_is_refused_naming_the_field(run_root, change, field):
    request = image_request(b"x", "http://127.0.0.1:9/x", "device=/dev/null")
    change(request)
    result = installer.install(request, progress=lambda _: None,
                               cancelled=threading.Event(), run_root=str(run_root))
    assert (result["status"], result["cause_kind"]) == ("refused", "bad_request"), result
    assert field in result["cause"]


# -- memory --------------------------------------------------------------------------

CHILD = """
import json, os, sys, threading
sys.path.insert(0, os.path.dirname(sys.argv[1]))  # as in the bundle: its modules beside it
import installer
result = installer.install(json.loads(sys.argv[2]), progress=lambda _: None,
                           cancelled=threading.Event())
print(json.dumps(result))
# VmHWM, the peak of this process's own memory: ru_maxrss (RUSAGE_SELF, or the parent's
# RUSAGE_CHILDREN) keeps the high-water mark of the memory forked from pytest across
# the exec, which measures pytest, not the installer.
print([line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")][0])
"""


@pytest.mark.timeout(120)
def test_resident_memory_stays_bounded_whatever_the_image_size(loops, serve, tmp_path):
    size = 256 * MiB
    image = tmp_path / "big.img"
    pattern = os.urandom(MiB)
    with open(image, "wb") as handle:
        for index in range(size // MiB):
            handle.write(pattern[index:] + pattern[:index])
    digest = hashlib.sha256()
    with open(image, "rb") as handle:
        for piece in iter(lambda: handle.read(8 * MiB), b""):
            digest.update(piece)
    loop = loops(size)
    server = serve(image)
    request = image_request(b"", server.url, f"device={loop.path}")
    request["image"].update(size=size, sha256=digest.hexdigest())
    child = subprocess.run(
        [sys.executable, "-c", CHILD, installer.__file__, json.dumps(request)],
        capture_output=True, text=True, timeout=100)
    assert child.returncode == 0, child.stderr
    lines = child.stdout.splitlines()
    result, peak_kib = json.loads(lines[0]), int(lines[1])
    assert result["status"] == "ok", result
    assert peak_kib < 64 * 1024, f"peak RSS {peak_kib} KiB"
    with contextlib.suppress(OSError):
        image.unlink()


def test_a_regular_file_is_a_disk_only_in_a_simulated_root(run_root, serve, tmp_path):
    """The simulator's machines (no root, no loop devices) have a file for a disk: it is
    written when it is the /dev node, under a sys_root other than "/", of a disk that
    root's /sys/block describes; named on the machine's own root it is no disk."""
    root = tmp_path / "sim-root"
    (root / "sys/block/sda").mkdir(parents=True)
    (root / "sys/block/sda/dev").write_text("8:0\n")
    (root / "sys/block/sda/size").write_text(f"{8 * MiB // 512}\n")
    (root / "proc").mkdir()
    (root / "proc/mounts").write_text("")
    (root / "dev").mkdir()
    disk = root / "dev/sda"
    after = os.urandom(4096)
    with open(disk, "wb") as handle:
        handle.truncate(8 * MiB)
        handle.seek(IMAGE_SIZE)
        handle.write(after)
    raw = os.urandom(IMAGE_SIZE)
    url = serve(raw).url
    done = installer.install(image_request(raw, url, "device=/dev/sda"),
                             progress=lambda _: None, cancelled=threading.Event(),
                             sys_root=str(root), run_root=str(run_root))
    assert done["status"] == "ok", done
    assert done["disk"] == "/dev/sda"  # as the machine names it
    assert done["written_sha256"] == done["read_back_sha256"] == hashlib.sha256(raw).hexdigest()
    with open(disk, "rb") as handle:
        assert handle.read(IMAGE_SIZE + len(after)) == raw + after
    assert disk.stat().st_size == 8 * MiB

    before = disk.read_bytes()[:IMAGE_SIZE]
    link = tmp_path / "by-id-sim-disk"  # a udev style link to the file, on "/"
    link.symlink_to(disk)
    plain = Run(image_request(os.urandom(MiB), url, str(link)), run_root)
    assert (plain.result["status"], plain.result["cause_kind"]) == ("refused", "not_a_disk")
    small = root / "sys/block/sda/size"
    small.write_text("8\n")
    refused = installer.install(image_request(raw, url, "device=/dev/sda"),
                                progress=lambda _: None, cancelled=threading.Event(),
                                sys_root=str(root), run_root=str(run_root))
    assert refused["cause_kind"] == "too_small", refused
    assert disk.read_bytes()[:IMAGE_SIZE] == before
