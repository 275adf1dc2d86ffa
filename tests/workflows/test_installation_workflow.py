"""The installation workflow (``shepherd.workflows.installation.install``) from the claim to
its outcome, on a real BMDB (PostgreSQL).

The machine's agent is played by a thread that reads the dispatched request as the
server would hand it out (``bmdb.installation_of``) and writes what a real agent's
heartbeats would (progress, then a report) in transactions of its own, so the workflow
sees exactly what it sees in production, minus the disk. Short poll, stall and deadline
settings keep each case to a second or two.
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization

import bmdb
from shepherd.agent.protocol import InstallationRequest
from shepherd.answer_key import AnswerKey
from shepherd.images import Catalog, Image
from shepherd.power import BootDevice
from shepherd.server.heartbeat import with_secrets
from shepherd.workflows.booting import BootSettings
from shepherd.workflows.common import WorkflowResult
from shepherd.workflows.installation import (
    CAUSE_KINDS,
    UNDEFINED,
    InstallationSettings,
    cause_kind,
    install,
)
from tests.support.bmdb_helpers import seed_provided, stored_interval

pytestmark = pytest.mark.timeout(30)

OS_INSTALL = bmdb.Process.OS_INSTALL
CALLBACK = "http://127.0.0.1:8470/"
RAW = b"shepherd test image\n" * 4096
SERVED = {"name": "debian-12", "file": "debian-12.raw", "sha256": hashlib.sha256(RAW).hexdigest(),
          "size": len(RAW), "format": "raw"}
ELSEWHERE = {"name": "ubuntu-24.04", "url": "https://images.example.net/ubuntu-24.04.raw.gz",
             "sha256": "ab" * 32, "size": 3 << 20, "format": "gzip"}
NEWER = {"name": "debian-13", "file": "debian-13.raw", "sha256": "cd" * 32, "size": 1 << 20,
         "format": "raw"}
DISK = "serial=WD-0042"


# -- the catalog, the BMDB and the machine --------------------------------------------------


def write_catalog(directory: Path, *images: dict[str, Any]) -> None:
    tables = []
    for image in images:
        lines = [f"{key} = {value!r}" if isinstance(value, int) else f'{key} = "{value}"'
                 for key, value in image.items()]
        tables.append("[[images]]\n" + "\n".join(lines))
    (directory / "catalog.toml").write_text("\n\n".join(tables) + "\n")


def test_a_catalog_entry_reads_back_as_the_same_image(tmp_path: Path) -> None:
    """``Image.catalog_entry``, which the simulator and the tests write catalogs with,
    is what ``Catalog.load`` reads: served and elsewhere, quotes in a URL included."""
    images = [Image("debian-12", "ab" * 32, 4096, "zstd", file="debian-12.raw.zst"),
              Image("ubuntu", "cd" * 32, 8192, "gzip", url='https://x.test/a"b.raw.gz')]
    (tmp_path / "catalog.toml").write_text("\n".join(i.catalog_entry() for i in images))
    catalog = Catalog.load(tmp_path)
    assert [catalog.get(image.name) for image in images] == images


@pytest.fixture
def settings(tmp_path: Path) -> InstallationSettings:
    write_catalog(tmp_path, SERVED, ELSEWHERE, NEWER)
    (tmp_path / "debian-12.raw").write_bytes(RAW)
    return InstallationSettings(callback_url=CALLBACK, image_dir=tmp_path, poll_interval=0.05,
                                stall_timeout=1.0, deadline=8.0)


@pytest.fixture
def db(pg_url: str) -> Iterator[bmdb.BMDB]:
    handle = bmdb.connect(pg_url, thresholds=bmdb.Thresholds(first_heartbeat=60, heartbeat=30))
    yield handle
    handle.close()


@pytest.fixture
def worker(db: bmdb.BMDB) -> Iterator[bmdb.Session]:
    with db.start_session("worker", interval=10) as session:
        yield session


def wanted_machine(session: bmdb.Session, image: str = "debian-12") -> uuid.UUID:
    """A Running machine whose agent heartbeats, and an operator's wish for ``image``."""
    (machine,) = seed_provided(session, 1)

    def body(tx: bmdb.Tx) -> None:
        bmdb.set_agent_started(tx, machine, b"\x01" * 32)
        bmdb.record_heartbeat(tx, machine, tx.now)
        bmdb.want_installation(tx, machine, image=image, disk=DISK, origin="operator",
                               by="alice", reason="ticket 4711")

    session.transact(body)
    return machine


def state(db: bmdb.BMDB, machine: uuid.UUID) -> bmdb.Installation:
    return db.read(lambda tx: bmdb.installation_of(tx, machine))


def wish(db: bmdb.BMDB, machine: uuid.UUID) -> bmdb.Wanted:
    found = state(db, machine).wanted
    assert found is not None, f"nothing wanted for {machine}"
    return found


def history(db: bmdb.BMDB, machine: uuid.UUID) -> list[tuple[str, str | None]]:
    """(event, cause) of the machine's installation history, oldest first."""
    rows = db.read(lambda tx: bmdb.machine_history(tx, machine))
    return [(row["event"], row["cause"]) for row in reversed(rows)
            if row["process"] == OS_INSTALL]


def events(db: bmdb.BMDB, machine: uuid.UUID) -> list[str]:
    return [event for event, _ in history(db, machine)]


# -- the agent ----------------------------------------------------------------------------

#: One heartbeat's writes: (tx, machine, generation, request).
Step = Callable[[bmdb.Tx, uuid.UUID, int, dict[str, Any]], None]


def progress(phase: str, done: int, total: int = len(RAW)) -> Step:
    def step(tx: bmdb.Tx, machine: uuid.UUID, generation: int, request: dict[str, Any]) -> None:
        bmdb.record_installation_progress(tx, machine, generation, {
            "phase": phase, "bytes_done": done, "bytes_total": total, "rate": 1e8,
            "eta_seconds": 0.1})
    return step


def report(**result: Any) -> Step:
    def step(tx: bmdb.Tx, machine: uuid.UUID, generation: int, request: dict[str, Any]) -> None:
        bmdb.set_os_installation_report(tx, machine, generation, result)
    return step


def withdraw(tx: bmdb.Tx, machine: uuid.UUID, generation: int, request: dict[str, Any]) -> None:
    """Not the agent: an operator's ``shepherd install --cancel`` in the middle."""
    bmdb.withdraw_installation(tx, machine, by="bob", reason="wrong machine")


def rewant(image: str) -> Step:
    """Not the agent: an operator asking for another image in the middle."""
    def step(tx: bmdb.Tx, machine: uuid.UUID, generation: int, request: dict[str, Any]) -> None:
        bmdb.want_installation(tx, machine, image=image, disk=DISK, origin="operator",
                               by="alice", reason="a newer release")
    return step


def ok(image: dict[str, Any] = SERVED, **changes: Any) -> Step:
    """What the agent reports after writing and reading back ``image`` in full."""
    return report(**{"status": "ok", "cause_kind": None, "cause": None, "disk": "/dev/loop5",
                     "bytes": image["size"], "written_sha256": image["sha256"],
                     "read_back_sha256": image["sha256"],
                     "durations": {"write": 0.2, "flush": 0.05, "read_back": 0.15},
                     "retries": 0, **changes})


@dataclass
class Agent:
    """The machine's agent: waits for a request newer than any it saw, then takes
    ``steps``, one heartbeat each (``pace`` apart); with ``keep_beating``, then goes on
    reporting the last progress until its request leaves the answers."""

    db: bmdb.BMDB
    machine: uuid.UUID
    steps: list[Step]
    pace: float = 0.1
    keep_beating: Step | None = None
    requests: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def __enter__(self) -> Agent:
        self.thread = threading.Thread(target=self.guarded, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.thread is not None
        self.thread.join(10)
        assert not self.thread.is_alive(), "the agent thread did not stop"
        if self.error is not None and exc[0] is None:
            raise self.error

    def guarded(self) -> None:
        try:
            self.run()
        except BaseException as error:  # re-raised in the test's thread
            self.error = error

    def run(self) -> None:
        flight = self.wait_for_request()
        if flight is None:
            return
        generation, request = flight
        for step in self.steps:
            self.beat(step, generation, request)
        while self.keep_beating is not None and self.in_flight() == generation:
            self.beat(self.keep_beating, generation, request)

    def beat(self, step: Step, generation: int, request: dict[str, Any]) -> None:
        """One heartbeat's writes, in a transaction of their own as the server's."""
        self.db.read(lambda tx: step(tx, self.machine, generation, request))
        time.sleep(self.pace)

    def wait_for_request(self, timeout: float = 5.0) -> tuple[int, dict[str, Any]] | None:
        """The request in flight as the server reads it for an answer; None if none came."""
        until = time.monotonic() + timeout
        while time.monotonic() < until:
            flight = state(self.db, self.machine).in_flight
            if flight is not None:
                self.requests.append((flight.generation, flight.request))
                return flight.generation, flight.request
            time.sleep(0.02)
        return None

    def in_flight(self) -> int | None:
        flight = state(self.db, self.machine).in_flight
        return None if flight is None else flight.generation


def run(worker: bmdb.Session, machine: uuid.UUID,
        settings: InstallationSettings) -> WorkflowResult:
    work = worker.claim_machine(OS_INSTALL, machine)
    return install(work, settings)


def assert_released(db: bmdb.BMDB, machine: uuid.UUID) -> None:
    """Whatever the outcome: no work holds the machine, and no request is answered."""
    assert db.read(lambda tx: bmdb.machine_work(tx, machine)) == []
    assert state(db, machine).in_flight is None
    assert db.read(lambda tx: bmdb.installations_in_progress(tx, 1000)) == []


# -- outcomes ------------------------------------------------------------------------------


def test_verified_installation_finishes_and_settles_the_wish(db, worker, settings):
    machine = wanted_machine(worker)
    steps = [progress("fetching", 0), progress("writing", len(RAW) // 2),
             progress("verifying", len(RAW)), ok()]
    with Agent(db, machine, steps) as agent:
        result = run(worker, machine, settings)
    assert (result.outcome, result.cause) == ("finished", None)
    assert_released(db, machine)
    settled = wish(db, machine)
    # Written, not installed: this machine has no BMC, so nothing can boot what was written.
    assert (settled.outcome, settled.generation) == ("written", 1)
    assert events(db, machine) == ["Wanted", "Started", "Dispatched", "Verified", "Finished"]
    dispatched, verified = history(db, machine)[2][1], history(db, machine)[3][1]
    assert dispatched is not None and verified is not None
    assert dispatched.startswith(f"generation 1: image debian-12 ({len(RAW)} bytes")
    assert DISK in dispatched
    assert f"sha256 {SERVED['sha256']} both ways" in verified and "/dev/loop5" in verified
    assert db.read(lambda tx: bmdb.machine_backoffs(tx, machine, OS_INSTALL)) == []
    # What the agent was handed: a served image, under the callback URL, no token stored.
    ((generation, request),) = agent.requests
    assert generation == 1
    assert request == {
        "kind": "image",
        "image": {"name": "debian-12", "url": "http://127.0.0.1:8470/agent/v1/images/debian-12",
                  "sha256": SERVED["sha256"], "size": len(RAW), "format": "raw",
                  "served": True},
        "disk": DISK, "machine_id": str(machine),
        "limits": {"retries": settings.fetch_retries, "stall_seconds": settings.fetch_stall,
                   "deadline_seconds": settings.deadline}}


def test_image_from_elsewhere_is_requested_by_its_own_url(db, worker, settings):
    machine = wanted_machine(worker, "ubuntu-24.04")
    with Agent(db, machine, [ok(ELSEWHERE)]) as agent:
        result = run(worker, machine, settings)
    assert result.outcome == "finished"
    ((_, request),) = agent.requests
    assert request["image"]["url"] == ELSEWHERE["url"]
    assert request["image"]["served"] is False and request["image"]["format"] == "gzip"
    assert "authorization" not in request
    assert db.read(lambda tx: bmdb.served_image_in_flight(tx, machine)) is None


def test_ok_report_that_does_not_match_the_catalog_fails_as_read_back(db, worker, settings):
    machine = wanted_machine(worker)
    with Agent(db, machine, [ok(read_back_sha256="00" * 32)]):
        result = run(worker, machine, settings)
    assert result.outcome == "failed" and result.cause is not None
    assert cause_kind(result.cause) == "read_back"
    assert "00" * 32 in result.cause and result.cause.endswith(UNDEFINED)
    assert_released(db, machine)
    assert stored_interval(db, machine, OS_INSTALL) == bmdb.INSTALL_BACKOFF.initial
    assert wish(db, machine).pending
    assert events(db, machine) == ["Wanted", "Started", "Dispatched", "Failed"]


def test_agents_failure_fails_with_its_cause_and_the_installation_backoff(db, worker,
                                                                           settings):
    machine = wanted_machine(worker)
    cause = f"wrote sha256 {'ee' * 32}, expected {SERVED['sha256']}" + UNDEFINED
    steps = [progress("writing", 4096),
             report(status="failed", cause_kind="digest", cause=cause, disk="/dev/loop5",
                    bytes=len(RAW), written_sha256="ee" * 32, read_back_sha256=None,
                    durations={"write": 0.1}, retries=1)]
    with Agent(db, machine, steps):
        result = run(worker, machine, settings)
    assert (result.outcome, result.cause) == ("failed", f"digest: {cause}")
    assert result.backoff_seconds == bmdb.INSTALL_BACKOFF.initial
    assert stored_interval(db, machine, OS_INSTALL) == bmdb.INSTALL_BACKOFF.initial
    (backoff,) = db.read(lambda tx: bmdb.machine_backoffs(tx, machine, OS_INSTALL))
    assert backoff.active and backoff.cause == result.cause
    assert_released(db, machine)
    assert wish(db, machine).pending  # tried again after the backoff
    assert history(db, machine)[-1] == ("Failed", f"digest: {cause}")


def test_a_silent_agent_fails_and_says_the_disk_may_have_been_written(db, worker, settings):
    """The agent may have begun writing before a heartbeat could say so: once dispatched,
    a silent agent's failure says the disk is undefined, whatever was last heard."""
    machine = wanted_machine(worker)
    started = time.monotonic()
    with Agent(db, machine, []):
        result = run(worker, machine, settings)
    assert result.outcome == "failed" and result.cause is not None
    assert result.cause.startswith("agent_silent: ") and "it never started" in result.cause
    assert result.cause.endswith(UNDEFINED)
    assert settings.stall_timeout <= time.monotonic() - started < settings.stall_timeout + 3
    assert stored_interval(db, machine, OS_INSTALL) == bmdb.INSTALL_BACKOFF.initial
    assert_released(db, machine)


def test_agent_silent_after_writing_leaves_the_disk_undefined(db, worker, settings):
    machine = wanted_machine(worker)
    with Agent(db, machine, [progress("fetching", 0), progress("writing", 3 << 20, 8 << 20)]):
        result = run(worker, machine, settings)
    assert result.outcome == "failed" and result.cause is not None
    assert cause_kind(result.cause) == "agent_silent"
    assert "last: writing 3 of 8 MiB" in result.cause and result.cause.endswith(UNDEFINED)
    assert_released(db, machine)


def test_agent_that_never_finishes_meets_the_deadline(db, worker, settings):
    """Progress keeps the stall timeout away; the deadline still ends it. Once the request
    leaves the answers, the agent (here: the thread) stops."""
    machine = wanted_machine(worker)
    # A stall timeout far beyond the deadline: only the deadline can end it, however
    # late a loaded machine runs the agent's thread.
    quick = InstallationSettings(callback_url=CALLBACK, image_dir=settings.image_dir,
                                 poll_interval=0.05, stall_timeout=60.0, deadline=1.5)
    with Agent(db, machine, [], keep_beating=progress("fetching", 0)):
        result = run(worker, machine, quick)
    assert result.outcome == "failed" and result.cause is not None
    assert result.cause.startswith("deadline: not done within 1.5 s (last: fetching")
    assert result.cause.endswith(UNDEFINED)
    assert_released(db, machine)


def test_operator_withdrawal_cancels_without_backoff(db, worker, settings):
    machine = wanted_machine(worker)
    with Agent(db, machine, [progress("writing", 4096), withdraw]):
        result = run(worker, machine, settings)
    assert result.outcome == "canceled" and result.backoff_seconds is None
    assert_released(db, machine)
    assert db.read(lambda tx: bmdb.machine_backoffs(tx, machine, OS_INSTALL)) == []
    withdrawn = wish(db, machine)
    assert (withdrawn.outcome, withdrawn.pending) == ("canceled", False)
    assert events(db, machine) == ["Wanted", "Started", "Dispatched", "Withdrawn", "Canceled"]
    assert history(db, machine)[3] == ("Withdrawn", "withdrawn by bob: wrong machine")


def test_image_missing_from_the_catalog_is_refused_before_any_dispatch(db, worker, settings):
    machine = wanted_machine(worker, "no-such-image")
    result = run(worker, machine, settings)
    assert result.outcome == "failed" and result.cause is not None
    assert cause_kind(result.cause) == "refused"
    assert "'no-such-image' is not in the catalog" in result.cause
    assert "nothing was written" in result.cause
    assert events(db, machine) == ["Wanted", "Started", "Failed"]
    assert wish(db, machine).generation == 0  # no generation spent
    assert stored_interval(db, machine, OS_INSTALL) == bmdb.INSTALL_BACKOFF.initial
    assert_released(db, machine)


def test_a_second_attempt_is_not_judged_by_the_first_ones_report(db, worker, settings):
    """The report of generation 1 stays stored while generation 2 runs: the workflow
    waits for generation 2's own."""
    machine = wanted_machine(worker)
    failed = report(status="failed", cause_kind="write", cause="EIO at 4096", disk="/dev/sdb",
                    bytes=4096, written_sha256=None, read_back_sha256=None, durations={},
                    retries=0)
    with Agent(db, machine, [failed]):
        assert run(worker, machine, settings).outcome == "failed"
    worker.transact(lambda tx: bmdb.clear_backoff(tx, machine, OS_INSTALL))
    with Agent(db, machine, [progress("writing", 1), ok()], pace=0.3) as agent:
        result = run(worker, machine, settings)
    assert result.outcome == "finished"
    assert [generation for generation, _ in agent.requests] == [2]
    assert wish(db, machine).outcome == "written"


def test_a_wish_changed_mid_way_is_not_taken_as_installed(db, worker, settings):
    machine = wanted_machine(worker)
    with Agent(db, machine, [progress("writing", 4096), rewant("debian-13"), ok()]):
        run(worker, machine, settings)
    changed = wish(db, machine)
    assert changed.image == "debian-13"
    assert changed.pending, "debian-13 was never written, yet its wish is settled"


# -- the token, and cause kinds ------------------------------------------------------------


def test_server_adds_the_fetch_token_only_to_a_served_image():
    key = AnswerKey.from_private_bytes(bytes(range(32)))
    machine = uuid.uuid4()

    def fetch_token() -> AnswerKey:
        """As the callback server reads it (``asgi``)."""
        return key

    served = InstallationRequest(3, {"kind": "image", "disk": DISK,
                                     "image": {"name": "debian-12", "served": True}})
    answered = with_secrets(machine, served, fetch_token)
    token = answered.request["authorization"]
    assert token == key.fetch_token(str(machine), 3, "debian-12")
    assert key.fetch_allowed(token, str(machine), 3, "debian-12")
    for other in ((str(uuid.uuid4()), 3, "debian-12"), (str(machine), 4, "debian-12"),
                  (str(machine), 3, "debian-13")):
        assert not key.fetch_allowed(token, *other)
    assert "authorization" not in served.request  # the stored request is untouched
    assert answered.generation == 3 and answered.request["image"] == served.request["image"]

    elsewhere = InstallationRequest(3, {"kind": "image",
                                        "image": {"name": "ubuntu", "served": False}})
    assert with_secrets(machine, elsewhere, fetch_token) == elsewhere
    assert with_secrets(machine, served, None) == served


def test_server_adds_the_private_host_key_only_for_the_pinned_public_half():
    """The identity's private half is derived per (machine, generation), never stored,
    and added only where the request names its public half: the key the workflow pinned."""
    key = AnswerKey.from_private_bytes(bytes(range(32)))
    machine = uuid.uuid4()
    chosen = key.host_key(str(machine), 5)
    assert chosen.public.startswith("ssh-ed25519 ")
    assert raw(chosen.private) == raw(key.host_key(str(machine), 5).private)
    assert chosen.public not in {key.host_key(str(machine), 6).public,
                                 key.host_key(str(uuid.uuid4()), 5).public}
    identity = {"hostname": "m1", "host_key": {"public": chosen.public}}
    pending = InstallationRequest(5, {"kind": "image", "identity": identity})
    answered = with_secrets(machine, pending, lambda: key)
    private = answered.request["identity"]["host_key"]["private_openssh"]
    assert raw(serialization.load_ssh_private_key(private.encode(), None)) == raw(chosen.private)
    assert "private_openssh" not in pending.request["identity"]["host_key"]
    other = InstallationRequest(6, {"kind": "image", "identity": identity})  # not gen 6's key
    assert "private_openssh" not in with_secrets(machine, other, lambda: key
                                                 ).request["identity"]["host_key"]


def raw(private: Any) -> bytes:
    return bytes(private.private_bytes(serialization.Encoding.Raw,
                                       serialization.PrivateFormat.Raw,
                                       serialization.NoEncryption()))


@pytest.mark.parametrize(("cause", "kind"), [
    ("digest: wrote sha256 ee..", "digest"),
    ("read_back: the agent said ok, but ...", "read_back"),
    ("agent_silent: no progress for 301 s (it never started)", "agent_silent"),
    ("refused: image 'x' is not in the catalog; nothing was written", "refused"),
    ("deadline: not done within 3600 s", "deadline"),
    ("no_disk: no disk has serial WD-0042", "no_disk"),
    ("generation 3 is no longer in flight", "other"),
    ("unexpected KeyError: 'image'", "other"),
    ("bmdb: machine has no Provided tag", "other"),
    ("", "other"),
    (None, "other"),
])
def test_cause_kind_is_a_bounded_label(cause, kind):
    assert cause_kind(cause) == kind
    assert kind in CAUSE_KINDS | {"other"}



def test_the_workers_installation_settings_come_from_the_environment(tmp_path) -> None:
    """What a worker builds from SHEPHERD_INSTALL_* and SHEPHERD_IMAGE_DIR: the workflow's
    settings, the installations' own in-flight cap, their backoff, and the task's limits."""
    import celeryconfig
    from shepherd import runtime
    from shepherd.config import Settings

    settings = Settings.from_env({
        "SHEPHERD_IMAGE_DIR": str(tmp_path), "SHEPHERD_INSTALL_IN_FLIGHT_CAP": "7",
        "SHEPHERD_INSTALL_STALL_TIMEOUT": "45", "SHEPHERD_INSTALL_DEADLINE": "900",
        "SHEPHERD_INSTALL_FETCH_RETRIES": "2", "SHEPHERD_INSTALL_FETCH_STALL": "12.5",
        "SHEPHERD_INSTALL_BACKOFF": "30,600,3", "SHEPHERD_CALLBACK_URL": CALLBACK,
        "SHEPHERD_INSTALL_SSH_DEADLINE": "200", "SHEPHERD_INSTALL_HEARTBEAT_DEADLINE": "60",
        "SHEPHERD_INSTALL_QUARANTINE_AFTER": "2", "SHEPHERD_INSTALL_RESCUE_DEVICE": "cd",
        "SHEPHERD_RUNG_TIMEOUT": "100"})
    built = runtime.installation_settings(settings)
    boot = BootSettings(takeover=runtime.initializer_settings(settings),
                        ladder=runtime.ladder_settings(settings), ssh_deadline=200.0,
                        heartbeat_deadline=60.0, rescue_device=BootDevice.CD)
    assert built == InstallationSettings(callback_url=CALLBACK, image_dir=tmp_path,
                                         stall_timeout=45.0, deadline=900.0, fetch_retries=2,
                                         fetch_stall=12.5, boot=boot, quarantine_after=2)
    assert built.boot is not None and built.boot.ladder.rung_timeout == 100.0
    assert runtime.sourcing_settings(settings, OS_INSTALL).in_flight_cap == 7
    assert runtime.sourcing_settings(settings, bmdb.Process.AGENT_START).in_flight_cap == 100
    assert runtime.backoffs(settings)[OS_INSTALL] == bmdb.Backoff(30, 600, 3.0)
    limits = celeryconfig.celery_settings(settings)["task_annotations"]["shepherd.install"]
    # The write's deadline, the installed system's boot (off and on, the banner, the first
    # heartbeat) and 300 s of room: 900 + 2 * 100 + 200 + 60 + 300.
    assert limits == {"time_limit": 1660.0, "soft_time_limit": 1600.0}
