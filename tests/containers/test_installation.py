"""Installing an operating system, end to end, on real parts: stock Debian machines
(``tests.support.minimal_systems``) each given a blank loop disk, the real agent taken
over through real SSH, the real callback server serving a real raw disk image built
from a debootstrapped system (``tests.support.disk_images``), and the installation
workflow seeing each installation to its outcome in the BMDB.

What the agent's writer does with cut, stalled or refused streams, swap, ambiguous
selectors and its memory is shown on loop devices directly (``tests/agent/
test_installer.py``); here, what travels: the request through signed answers, the
image through the server's token-bound route or another server, the progress and the
report through heartbeats, and the outcome into history, backoffs and settled rows.
Each written disk is checked independently: its bytes hashed by the test.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import bmdb
from shepherd.config import Settings
from shepherd.images import Format, Image
from shepherd.inventory.provider import StaticProvider
from shepherd.providers import ssh_keys
from shepherd.providers.base import register_provided
from shepherd.server import RunningServer, serve
from shepherd.workflows import InitializerSettings, initialize
from shepherd.workflows.common import WorkflowResult
from shepherd.workflows.installation import InstallationSettings, install
from tests.support.agent_fixtures import tags_of
from tests.support.disk_images import MIB, OsImage, loop_disk, os_image, require_disks
from tests.support.image_server import ImageServer
from tests.support.minimal_systems import (
    Changes,
    StockMachine,
    require_minimal_systems,
    rootfs,
    stock_machine,
)
from tests.support.servers import free_port
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.stock_machines, pytest.mark.timeout(900)]

#: Room for the image (``os_image``'s 320 MiB: small, since every case writes, reads
#: back and hashes it several times on a CI machine's two cores) and a little more.
DISK_SIZE = 384 * MIB


@pytest.fixture(autouse=True)
def _requirements() -> None:
    require_minimal_systems()
    require_disks()


@pytest.fixture
def db(pg_url: str) -> Iterator[bmdb.BMDB]:
    handle = bmdb.connect(pg_url, thresholds=bmdb.Thresholds(first_heartbeat=60, heartbeat=30))
    yield handle
    handle.close()


@pytest.fixture
def image() -> OsImage:
    return os_image("bookworm")


@pytest.fixture
def image_dir(tmp_path: Path, image: OsImage) -> Path:
    """Shepherd's image directory: the image's files linked in (not symlinked: the server
    serves nothing that leads out of its directory), and a catalog written per test."""
    directory = tmp_path / "images"
    directory.mkdir()
    for kind in ("raw", "gzip", "zstd"):
        source = image.file(kind)
        try:
            os.link(source, directory / source.name)
        except OSError:
            shutil.copyfile(source, directory / source.name)
    return directory


@pytest.fixture
def server(db: bmdb.BMDB, image_dir: Path) -> Iterator[RunningServer]:
    settings = Settings(bmdb_url=db.url, serve_listen="127.0.0.1:0", session_interval=2,
                        serve_threads=8, image_dir=image_dir)
    with serve(settings, db=db) as running:
        yield running


@pytest.fixture
def key_path(tmp_path: Path) -> Path:
    path = tmp_path / "shepherd_key"
    ssh_keys.load_or_create(path)
    return path


def catalog(image_dir: Path, *entries: str) -> None:
    (image_dir / "catalog.toml").write_text("\n".join(entries))


def entry(name: str, image: OsImage, kind: Format = "raw", *, sha256: str | None = None,
          url: str | None = None) -> str:
    return Image(name, sha256 or image.sha256, image.size, kind,
                 file=None if url else image.file(kind).name, url=url).catalog_entry()


@dataclass
class Rig:
    """One test's machines, their BMDB session and where agents call back."""

    db: bmdb.BMDB
    session: bmdb.Session
    server: RunningServer
    image_dir: Path
    key_path: Path
    tmp_path: Path

    def settings(self, **changes: float) -> InstallationSettings:
        values = {"poll_interval": 0.2, "stall_timeout": 20.0, "deadline": 300.0,
                  "fetch_retries": 3, "fetch_stall": 5.0, **changes}
        return InstallationSettings(callback_url=self.server.url, image_dir=self.image_dir,
                                    **values)  # type: ignore[arg-type]

    def initializer(self) -> InitializerSettings:
        return InitializerSettings(ssh_key_path=self.key_path, callback_url=self.server.url,
                                   connect_timeout=5.0, exec_timeout=30.0,
                                   agent_args=("--interval", "0.3", "--max-backoff", "1"))

    @contextlib.contextmanager
    def machine(self, name: str, *, extra: tuple[str, ...] = (),
                more: tuple[str, ...] = ()) -> Iterator[Machine]:
        """A stock machine with a blank loop disk at /dev/<loopN> inside, taken over."""
        public = ssh_keys.public_key_path(self.key_path).read_text().strip()
        with loop_disk(self.tmp_path / f"{name}.disk", DISK_SIZE) as device:
            lines = disk_lines(device) + more
            with stock_machine(rootfs("bookworm", extra), self.tmp_path / name, public,
                               Changes(extra_lines=lines)) as stock:
                machine = Machine(name, stock, device, self.take_over(name, stock))
                yield machine

    def take_over(self, name: str, stock: StockMachine) -> uuid.UUID:
        inventory = self.tmp_path / f"{name}.toml"
        inventory.write_text(f'[[machines]]\nid = "{name}"\naddress = "{stock.address}"\n'
                             f'ssh_port = {stock.port}\nhost_key = "{stock.host_key}"\n')
        provider = StaticProvider(inventory)
        machine_id = self.session.transact(
            lambda tx: register_provided(tx, provider.name, provider.get_machine(name)))
        self.start_agent(machine_id, provider)
        return machine_id

    def start_agent(self, machine_id: uuid.UUID, provider: StaticProvider) -> None:
        work = self.session.claim_machine(bmdb.Process.AGENT_START, machine_id)
        result = initialize(work, provider, self.initializer())
        assert result.ok, result.cause
        wait_until(lambda: tags_of(self.db, machine_id).get("AgentHeartbeat"), timeout=20,
                   what="the agent's first heartbeat")

    def want(self, machine_id: uuid.UUID, image: str, disk: str) -> None:
        self.session.transact(lambda tx: bmdb.want_installation(
            tx, machine_id, image=image, disk=disk, origin="operator", by="test",
            reason="the test asks"))

    def install(self, machine_id: uuid.UUID, **changes: float) -> WorkflowResult:
        work = self.session.claim_machine(bmdb.Process.OS_INSTALL, machine_id)
        return install(work, self.settings(**changes))

    def installation(self, machine_id: uuid.UUID) -> bmdb.Installation:
        return self.db.read(lambda tx: bmdb.installation_of(tx, machine_id))

    def events(self, machine_id: uuid.UUID) -> list[tuple[str, str | None]]:
        rows = self.db.read(lambda tx: bmdb.machine_history(tx, machine_id, limit=50))
        return [(row["event"], row["cause"]) for row in reversed(rows)
                if row["process"] == bmdb.Process.OS_INSTALL.value]


@dataclass
class Machine:
    name: str
    stock: StockMachine
    device: str
    id: uuid.UUID

    @property
    def selector(self) -> str:
        return f"device={self.device}"

    def disk_sha256(self, size: int) -> str:
        """The disk's first ``size`` bytes, hashed by the test (not by the agent)."""
        digest = hashlib.sha256()
        with open(self.device, "rb") as disk:
            left = size
            while left:
                chunk = disk.read(min(left, 8 * MIB))
                if not chunk:
                    break
                digest.update(chunk)
                left -= len(chunk)
        return digest.hexdigest()


def disk_lines(device: str) -> tuple[str, ...]:
    """Make the loop disk the machine's own: its node in the machine's /dev, and a udev
    style by-id link to it."""
    name = device.removeprefix("/dev/")
    return (f'touch "$M/dev/{name}"', f'mount --bind {device} "$M/dev/{name}"',
            'mkdir -p "$M/dev/disk/by-id"', f'ln -sf ../../{name} "$M/dev/disk/by-id/test-{name}"')


@pytest.fixture
def rig(db: bmdb.BMDB, session: bmdb.Session, server: RunningServer, image_dir: Path,
        key_path: Path, tmp_path: Path) -> Rig:
    return Rig(db, session, server, image_dir, key_path, tmp_path)


# -- the cases ---------------------------------------------------------------------------


def test_an_image_served_by_shepherd_is_written_and_read_back(rig: Rig, image: OsImage) -> None:
    catalog(rig.image_dir, entry("bookworm", image))
    with rig.machine("m1") as machine:
        rig.want(machine.id, "bookworm", f"/dev/disk/by-id/test-{machine.device[5:]}")
        result = rig.install(machine.id)
        assert result.ok, result.cause
        assert machine.disk_sha256(image.size) == image.sha256
        state = rig.installation(machine.id)
        # Written, not installed: this machine has no BMC to boot what was written.
        assert state.wanted is not None and state.wanted.outcome == "written"
        assert state.in_flight is None
        assert state.report is not None
        report = state.report.result
        assert (report["status"], report["bytes"]) == ("ok", image.size)
        assert report["written_sha256"] == report["read_back_sha256"] == image.sha256
        events = [event for event, _ in rig.events(machine.id)]
        assert events == ["Wanted", "Started", "Dispatched", "Verified", "Finished"], events


def test_a_gzip_image_from_another_http_server_is_written(rig: Rig, image: OsImage,
                                                          image_dir: Path) -> None:
    with plain_http_server(image_dir) as base:
        catalog(rig.image_dir, entry("elsewhere", image, "gzip",
                                     url=f"{base}/{image.file('gzip').name}"))
        with rig.machine("m1") as machine:
            rig.want(machine.id, "elsewhere", machine.selector)
            result = rig.install(machine.id)
            assert result.ok, result.cause
            assert machine.disk_sha256(image.size) == image.sha256


def test_a_zstd_image_is_decompressed_while_streaming(rig: Rig, image: OsImage) -> None:
    catalog(rig.image_dir, entry("small", image, "zstd"))
    with rig.machine("m1", extra=("zstd",)) as machine:
        rig.want(machine.id, "small", machine.selector)
        result = rig.install(machine.id)
        assert result.ok, result.cause
        assert machine.disk_sha256(image.size) == image.sha256


def test_a_wrong_digest_fails_with_a_backoff_and_says_the_disk_is_undefined(
        rig: Rig, image: OsImage) -> None:
    catalog(rig.image_dir, entry("bad", image, sha256="0" * 64))
    with rig.machine("m1") as machine:
        rig.want(machine.id, "bad", machine.selector)
        result = rig.install(machine.id)
        assert not result.ok
        assert result.cause is not None and result.cause.startswith("digest:"), result.cause
        assert "the disk's contents are now undefined" in result.cause
        backoffs = rig.db.read(lambda tx: bmdb.machine_backoffs(tx, machine.id,
                                                                bmdb.Process.OS_INSTALL))
        assert backoffs and backoffs[0].active
        state = rig.installation(machine.id)
        assert state.in_flight is None and state.wanted is not None and state.wanted.pending


def test_a_mounted_disk_is_refused_and_left_unchanged(rig: Rig, image: OsImage,
                                                      tmp_path: Path) -> None:
    catalog(rig.image_dir, entry("bookworm", image))
    # Read-only, without replaying the journal: a mount that writes nothing, so the
    # disk's bytes before and after the refusal are the installation's doing alone.
    mounted = ('mkdir -p "$M/mnt/data"',
               'mount -o ro,noload "$M/dev/${DISK##*/}" "$M/mnt/data"')
    with loop_formatted(tmp_path) as device:
        lines = (f"DISK={device}", *disk_lines(device), *mounted)
        public = ssh_keys.public_key_path(rig.key_path).read_text().strip()
        with stock_machine(rootfs("bookworm"), tmp_path / "m1", public,
                           Changes(extra_lines=lines)) as stock:
            machine_id = rig.take_over("m1", stock)
            rig.want(machine_id, "bookworm", f"device={device}")
            before = sha256_of_device(device, 16 * MIB)
            result = rig.install(machine_id)
            after = sha256_of_device(device, 16 * MIB)
        assert not result.ok
        assert result.cause is not None and result.cause.startswith("mounted:"), result.cause
        assert "nothing was written" in result.cause
        assert "undefined" not in result.cause
        assert after == before


def test_a_killed_agent_fails_the_installation_and_a_new_request_starts_over(
        rig: Rig, image: OsImage) -> None:
    server = ImageServer(image.raw)
    server.stall_after = 64 * MIB  # the agent is still writing when it is killed
    try:
        catalog(rig.image_dir, entry("bookworm", image, url=server.url))
        with rig.machine("m1") as machine:
            rig.want(machine.id, "bookworm", machine.selector)
            killer = threading.Thread(target=kill_agent_once_writing, args=(rig, machine))
            killer.start()
            result = rig.install(machine.id, stall_timeout=3.0, fetch_stall=120.0)
            killer.join(timeout=60)
            assert not result.ok
            assert result.cause is not None and result.cause.startswith("agent_silent:")
            assert "the disk's contents are now undefined" in result.cause
            server.stall_after = None
            start_over(rig, machine)
            assert rig.installation(machine.id).report.generation == 2  # type: ignore[union-attr]
            assert machine.disk_sha256(image.size) == image.sha256
    finally:
        server.stop()


def start_over(rig: Rig, machine: Machine) -> None:
    """A new agent (Recovery's part, done here by hand), a cleared backoff: the next
    installation is a new generation, written from its first byte."""
    def forget_agent_and_backoff(tx: bmdb.Tx) -> None:
        bmdb.delete_agent_started(tx, machine.id)
        bmdb.clear_backoff(tx, machine.id, bmdb.Process.OS_INSTALL)

    rig.session.transact(forget_agent_and_backoff)
    rig.start_agent(machine.id, StaticProvider(rig.tmp_path / "m1.toml"))
    again = rig.install(machine.id)
    assert again.ok, again.cause


def test_a_withdrawn_installation_stops_the_write(rig: Rig, image: OsImage) -> None:
    """``shepherd install --cancel`` mid-way: the workflow cancels (no backoff), the
    answers stop carrying the request, and the agent stops writing and says so."""
    server = ImageServer(image.raw)
    server.stall_after = 64 * MIB  # the agent writes, then waits: the cancel meets it there
    try:
        catalog(rig.image_dir, entry("bookworm", image, url=server.url))
        with rig.machine("m1") as machine:
            rig.want(machine.id, "bookworm", machine.selector)
            withdrawer = threading.Thread(target=withdraw_once_writing, args=(rig, machine))
            withdrawer.start()
            result = rig.install(machine.id, fetch_stall=120.0)
            withdrawer.join(timeout=60)
            assert_canceled(rig, machine, result)
    finally:
        server.stop()


def assert_canceled(rig: Rig, machine: Machine, result: WorkflowResult) -> None:
    assert result.outcome == "canceled", result
    backoffs = rig.db.read(lambda tx: bmdb.machine_backoffs(tx, machine.id,
                                                            bmdb.Process.OS_INSTALL))
    assert not backoffs
    report = wait_until(lambda: rig.installation(machine.id).report, timeout=30,
                        what="the agent's report of the cancelled installation")
    assert report.result["status"] == "canceled", report.result
    assert report.result["cause"].endswith("the disk's contents are now undefined")


def withdraw_once_writing(rig: Rig, machine: Machine) -> None:
    wait_until(lambda: writing(rig, machine), timeout=60, what="the agent writing")
    rig.session.transact(lambda tx: bmdb.withdraw_installation(tx, machine.id, by="test",
                                                               reason="changed my mind"))


def writing(rig: Rig, machine: Machine) -> bool:
    flight = rig.installation(machine.id).in_flight
    return bool(flight and flight.progress and flight.progress.get("phase") == "writing")


def test_two_machines_install_from_one_server_at_once(rig: Rig, image: OsImage) -> None:
    catalog(rig.image_dir, entry("bookworm", image))
    with rig.machine("m1") as first, rig.machine("m2") as second:
        for machine in (first, second):
            rig.want(machine.id, "bookworm", machine.selector)
        works = rig.session.claim_backlog(bmdb.Process.OS_INSTALL, 2)
        assert {work.machine_id for work in works} == {first.id, second.id}
        results: list[WorkflowResult] = []
        def run(work: bmdb.Work) -> None:
            results.append(install(work, rig.settings()))

        threads = [threading.Thread(target=run, args=(work,)) for work in works]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert [result.cause for result in results if not result.ok] == []
        assert len(results) == 2
        for machine in (first, second):
            assert machine.disk_sha256(image.size) == image.sha256


def test_an_old_generation_answered_again_writes_nothing(rig: Rig, image: OsImage) -> None:
    """After generation 1 was written, the BMDB answers generation 1 again (as a replayed
    or stale answer would): the agent, which runs no generation twice, leaves the disk."""
    catalog(rig.image_dir, entry("bookworm", image))
    with rig.machine("m1") as machine:
        rig.want(machine.id, "bookworm", machine.selector)
        result = rig.install(machine.id)
        assert result.ok, result.cause
        zero_first_mib(machine.device)

        def answer_generation_one_again(tx: bmdb.Tx) -> None:
            bmdb.delete_os_installation_report(tx, machine.id)
            bmdb.set_os_installation_request(tx, machine.id, 1, request_of_generation_one(
                rig, image, machine))

        rig.session.transact(answer_generation_one_again)
        heartbeats_pass(rig, machine.id, 5)
        assert sha256_of_device(machine.device, MIB) == hashlib.sha256(bytes(MIB)).hexdigest()
        assert rig.installation(machine.id).report is None


# -- helpers ---------------------------------------------------------------------------


def request_of_generation_one(rig: Rig, image: OsImage, machine: Machine) -> dict[str, object]:
    from shepherd.images import Catalog
    from shepherd.workflows.installation import request_for

    return request_for(machine.id, Catalog.load(rig.image_dir).get("bookworm"),
                       machine.selector, rig.settings())


def heartbeats_pass(rig: Rig, machine_id: uuid.UUID, count: int) -> None:
    def signed_at() -> object:
        return tags_of(rig.db, machine_id)["AgentHeartbeat"]["last_signed_at"]

    seen = [signed_at()]
    for _ in range(count):
        wait_until(lambda: signed_at() != seen[-1], timeout=10, what="another heartbeat")
        seen.append(signed_at())


def kill_agent_once_writing(rig: Rig, machine: Machine) -> None:
    """SIGKILL the machine's agent once it reports writing: an agent gone mid-way."""
    wait_until(lambda: writing(rig, machine), timeout=60, what="the agent writing")
    for pid in agent_pids(machine.stock):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def agent_pids(stock: StockMachine) -> list[int]:
    """Host pids of the agent processes inside this machine (its root is the machine's)."""
    root = str((stock.workdir / "merged").resolve())
    found = []
    for entry_name in os.listdir("/proc"):
        if not entry_name.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry_name}/cmdline").read_bytes()
            if b"shepherd-agent" in cmdline and os.readlink(f"/proc/{entry_name}/root") == root:
                found.append(int(entry_name))
        except OSError:
            continue
    assert found, "no agent process found in the machine"
    return found


def zero_first_mib(device: str) -> None:
    with open(device, "r+b") as disk:
        disk.write(bytes(MIB))
        disk.flush()
        os.fsync(disk.fileno())


def sha256_of_device(device: str, size: int) -> str:
    with open(device, "rb") as disk:
        return hashlib.sha256(disk.read(size)).hexdigest()


@contextlib.contextmanager
def loop_formatted(tmp_path: Path) -> Iterator[str]:
    """A loop disk holding an ext4 filesystem initialised in full, so that once mounted
    nothing writes to it in the background (no lazy inode table or journal init)."""
    with loop_disk(tmp_path / "formatted.disk", DISK_SIZE) as device:
        subprocess.run(["mke2fs", "-q", "-t", "ext4", "-F", "-E",
                        "lazy_itable_init=0,lazy_journal_init=0", device],
                       check=True, timeout=120)
        yield device


@contextlib.contextmanager
def plain_http_server(directory: Path) -> Iterator[str]:
    """Python's own http.server (no Range support) on a free loopback port."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port),
         "--directory", str(directory)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers(base), timeout=10, what="http.server listening")
        yield base
    finally:
        process.terminate()
        process.wait(timeout=10)


def _answers(base: str) -> bool:
    import urllib.request

    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(base + "/", timeout=1):
            return True
    except OSError:
        return False
