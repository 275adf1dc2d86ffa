"""``shepherd up``'s live progress (``shepherd.up.progress``) against a real BMDB.

The snapshot is read from fleets built with the BMDB's own writers (claims, failures,
heartbeats, refusals, a session that died holding work), on both backends. The plain
mode is read back from a non-terminal stream; the live mode from the master end of a
real pseudo-terminal, so its terminal detection is the real one.
"""

from __future__ import annotations

import datetime as dt
import io
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

import bmdb
from shepherd.up import progress
from shepherd.up.progress import BackoffSummary, Snapshot, for_stream, read_snapshot
from shepherd.workflows.guard import GuardLimits
from tests.support.bmdb_helpers import seed_provided, start_agent

STAMP = re.compile(r"^\d\d:\d\d:\d\d ")
ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-_]")
NO_HTTP = GuardLimits()  # no healthz_url: the guard asks the BMDB only
REFUSAL = ("FLEET MISMATCH: 2 at the provider but not in the BMDB; "
           "set SHEPHERD_ASSIMILATE=true")


def heartbeat(session: bmdb.Session, machine_id: uuid.UUID) -> None:
    signed = dt.datetime.now(dt.UTC)
    session.transact(lambda tx: bmdb.record_heartbeat(tx, machine_id, signed))


def heartbeating(session: bmdb.Session, count: int) -> list[uuid.UUID]:
    """``count`` machines provided, agent started and heartbeating."""
    ids = seed_provided(session, count)
    for machine in ids:
        start_agent(session, machine)
        heartbeat(session, machine)
    return ids


def fail(session: bmdb.Session, machine: uuid.UUID, cause: str) -> None:
    session.claim_machine(bmdb.Process.AGENT_START, machine).fail(cause)
    time.sleep(0.01)  # distinct failure times, so "newest first" is one order


@dataclass
class Fleet:
    heartbeating: list[uuid.UUID]
    silent: uuid.UUID
    failed: list[uuid.UUID]
    held: list[uuid.UUID]


@pytest.fixture
def fleet(db: bmdb.BMDB, session: bmdb.Session) -> Iterator[Fleet]:
    """9 machines: 3 heartbeating, 1 agent started but silent, 3 in AgentStart backoff
    (two alike causes), 1 held by AgentStart work, 1 by Power work of a session that
    died unswept; and a standing reconcile refusal."""
    live = heartbeating(session, 3)
    silent, *rest = seed_provided(session, 6)
    start_agent(session, silent)
    failed, held = rest[:3], rest[3:]
    fail(session, failed[0], "ssh: connection refused")
    fail(session, failed[1], "agent upload failed:\n\x1b[31mdisk full\x1b[0m\non /tmp")
    fail(session, failed[2], "ssh: connection refused")
    session.claim_machine(bmdb.Process.AGENT_START, held[0])
    dying = db.start_session("doomed", interval=1)
    dying.claim_machine(bmdb.Process.POWER, held[1])
    dying.close()  # its deadline is now: dead, and nobody swept it
    db.read(lambda tx: bmdb.record_refusal(tx, "equinix", REFUSAL))
    yield Fleet(live, silent, failed, held)


# -- reading ----------------------------------------------------------------------------


def test_snapshot_counts_work_backoffs_and_problems(db, fleet):
    snap = read_snapshot(db, NO_HTTP)
    assert isinstance(snap, Snapshot), snap
    c = snap.counts
    assert (c.machines, c.provided, c.agent_started, c.heartbeating) == (9, 9, 4, 3)
    assert snap.in_flight == {"AgentStart": 1, "Recovery": 0, "Power": 1, "OSInstall": 0}
    # Newest first, alike causes once, each cut to one printable line.
    assert snap.backoffs == [BackoffSummary(
        "AgentStart", 3, ("ssh: connection refused", "agent upload failed: disk full on /tmp"))]
    assert [(r.provider, r.cause) for r in snap.refusals] == [("equinix", REFUSAL)]
    assert snap.guard is None
    assert snap.guard_figures.startswith("0 of 4 started agents silent")
    assert (snap.dead.sessions, snap.dead.work) == (1, 1)
    assert not snap.all_heartbeating


def test_snapshot_after_the_sweep_and_a_cleared_backoff(db, session, fleet):
    """The same reads follow the fleet: the sweep releases the dead session's work, and
    an operator's clearing of a backoff takes its machine out of the count."""
    db.sweep()
    session.transact(lambda tx: bmdb.clear_backoff(tx, fleet.failed[0],
                                                        bmdb.Process.AGENT_START))
    snap = read_snapshot(db, NO_HTTP)
    assert isinstance(snap, Snapshot), snap
    assert snap.in_flight["Power"] == 0
    assert (snap.dead.sessions, snap.dead.work) == (0, 0)
    assert [(b.process, b.machines) for b in snap.backoffs] == [("AgentStart", 2)]


def test_the_guard_pause_is_in_plain_words(db, fleet):
    snap = read_snapshot(db, GuardLimits(reboots_per_hour=0))
    assert isinstance(snap, Snapshot), snap
    assert snap.guard == "0 reboots in the last hour reach the limit of 0 per hour"


def test_an_unreachable_callback_server_pauses_recovery_quickly(db, fleet):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    began = time.monotonic()
    snap = read_snapshot(db, GuardLimits(healthz_url=f"http://127.0.0.1:{port}/healthz",
                                         healthz_timeout=60))
    assert time.monotonic() - began < progress.HEALTHZ_TIMEOUT + 5
    assert isinstance(snap, Snapshot), snap
    assert snap.guard is not None and snap.guard.startswith(
        f"callback server http://127.0.0.1:{port}/healthz unreachable")
    assert "callback server UNHEALTHY" in snap.guard_figures


def test_an_unmigrated_bmdb_is_said_in_one_line(tmp_path):
    db = bmdb.connect(f"sqlite:///{tmp_path / 'empty.sqlite'}")
    try:
        said = read_snapshot(db, NO_HTTP)
    finally:
        db.close()
    assert isinstance(said, str)
    assert said.startswith("BMDB not readable now: Unavailable: ")
    assert "no such table" in said and "\n" not in said


# -- plain lines ------------------------------------------------------------------------


def plain_lines(out: io.StringIO) -> list[str]:
    text = out.getvalue()
    assert "\x1b" not in text and "\r" not in text
    lines = text.splitlines()
    assert all(STAMP.match(line) for line in lines), lines
    return [line[9:] for line in lines]


def test_plain_is_one_line_per_change(db, session, fleet):
    out = io.StringIO()  # not a terminal
    shown = for_stream(out)
    shown.show(read_snapshot(db, NO_HTTP))
    shown.show(read_snapshot(db, NO_HTTP))  # nothing changed: nothing said
    first = plain_lines(out)
    assert first[0] == (
        "machines 9  provided 9  agent started 4  heartbeating 3  in backoff 3  "
        "in flight: AgentStart 1, Power 1  | AgentStart backoff 3, latest: ssh: "
        "connection refused  | RECONCILE REFUSING (equinix)")
    assert first[1].startswith("RECONCILE REFUSING for equinix (since ")
    assert first[1].endswith(f"): {REFUSAL}")
    assert first[2].startswith("1 work items held by 1 dead sessions")
    assert len(first) == 3
    heartbeat(session, fleet.silent)
    shown.show(read_snapshot(db, NO_HTTP))
    shown.event("worker-machines died (status -9); restarting in 2 s")
    shown.close()
    later = plain_lines(out)[3:]
    assert later == [first[0].replace("heartbeating 3", "heartbeating 4"),
                     "worker-machines died (status -9); restarting in 2 s"]


def test_plain_repeats_an_unchanged_line_after_a_while(db, fleet, monkeypatch):
    out = io.StringIO()
    shown = for_stream(out)
    snap = read_snapshot(db, NO_HTTP)
    shown.show(snap)
    monkeypatch.setattr(progress.plain, "REPEAT_AFTER", 0.0)
    shown.show(snap)
    statuses = [line for line in plain_lines(out) if line.startswith("machines ")]
    assert len(statuses) == 2 and statuses[0] == statuses[1]


def test_all_heartbeating_is_said_once_and_again_after_a_drop(db, session):
    out = io.StringIO()
    shown = for_stream(out, started=time.time() - 41)
    heartbeating(session, 3)
    for _ in range(3):
        shown.show(read_snapshot(db, NO_HTTP))
    said = [line for line in plain_lines(out) if "heartbeating (" in line
            or line.startswith(("all ", "no longer"))]
    assert len(said) == 1
    assert re.fullmatch(r"all 3 machines heartbeating \(first at \d\d:\d\d:\d\d, "
                        r"4[1-3] s after start\)", said[0]), said
    (newcomer,) = seed_provided(session, 1)  # the fleet grows: not all heartbeat now
    shown.show(read_snapshot(db, NO_HTTP))
    start_agent(session, newcomer)
    heartbeat(session, newcomer)
    for _ in range(2):
        shown.show(read_snapshot(db, NO_HTTP))
    said = [line for line in plain_lines(out) if line.startswith(("all ", "no longer"))]
    assert len(said) == 3, said
    assert said[1].startswith("no longer all heartbeating: 3 of 4 machines")
    assert said[2].startswith("all 4 machines heartbeating again (at ")


def test_plain_says_a_refusal_and_a_pause_when_they_start_and_end(db, fleet):
    out = io.StringIO()
    shown = for_stream(out)
    shown.show(read_snapshot(db, GuardLimits(reboots_per_hour=0)))
    shown.show(read_snapshot(db, GuardLimits(reboots_per_hour=0)))
    db.read(lambda tx: bmdb.clear_refusal(tx, "equinix"))
    shown.show(read_snapshot(db, NO_HTTP))
    shown.show(read_snapshot(db, NO_HTTP))
    lines = plain_lines(out)
    assert [line for line in lines if "REFUSING for" in line or "goes through" in line] == [
        next(line for line in lines if line.startswith("RECONCILE REFUSING for equinix")),
        "reconcile of equinix goes through again: no longer refusing"]
    assert [line for line in lines if line.startswith("Recovery")] == [
        "Recovery PAUSED: 0 reboots in the last hour reach the limit of 0 per hour",
        "Recovery may run again: the guard no longer pauses it"]


def test_an_unreadable_bmdb_is_a_plain_line(tmp_path):
    out = io.StringIO()
    shown = for_stream(out)
    shown.show("BMDB not readable now: OperationalError: database is locked")
    shown.show("BMDB not readable now: OperationalError: database is locked")
    assert plain_lines(out) == ["BMDB not readable now: OperationalError: database is locked"]


# -- a real terminal --------------------------------------------------------------------


class Terminal:
    """A pseudo-terminal: ``slave`` is what the progress writes to (a real TTY),
    ``screen()`` what the master end read, drained meanwhile so writes never block."""

    def __init__(self) -> None:
        master, slave = os.openpty()
        self.master = master
        self.slave = os.fdopen(slave, "w", encoding="utf-8", buffering=1)
        self.read = bytearray()
        self.reader = threading.Thread(target=self._drain, daemon=True)
        self.reader.start()

    def _drain(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: the slave end is closed
                return
            if not chunk:
                return
            self.read += chunk

    def screen(self) -> str:
        """Everything written, once the slave is closed and the reader has read it."""
        self.slave.close()
        self.reader.join(10)
        os.close(self.master)
        return self.read.decode("utf-8", errors="replace")


@pytest.fixture
def terminal(monkeypatch) -> Iterator[Terminal]:
    monkeypatch.setenv("COLUMNS", "120")
    for name in ("TTY_COMPATIBLE", "FORCE_COLOR", "NO_COLOR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    tty = Terminal()
    yield tty
    if not tty.slave.closed:
        tty.screen()


def test_a_terminal_gets_the_live_panel(db, fleet, terminal):
    assert terminal.slave.isatty()
    shown = for_stream(terminal.slave)
    shown.show(read_snapshot(db, GuardLimits(reboots_per_hour=0)))
    shown.event("worker-machines died (status -9); restarting in 2 s")
    shown.show(read_snapshot(db, GuardLimits(reboots_per_hour=0)))  # redrawn in place
    shown.close()
    raw = terminal.screen()
    assert "\x1b[" in raw  # colours and cursor movement: not the plain mode
    assert "\x1b[1A" in raw or "\x1b[2K" in raw  # the panel is redrawn where it was
    # Cursor movements and erasures end a line on screen: here too, then no escapes.
    text = ANSI.sub("", re.sub(r"\x1b\[\d*[ABK]|\r", "\n", raw))
    for expected in ("toward all heartbeating: 3 of 9 machines", "provided", "9/9",
                     "agent started", "4/9", "heartbeating", "3/9", "━",
                     "machines by state", "work in flight", "in backoff",
                     "ssh: connection refused", "agent upload failed: disk full on /tmp",
                     "Recovery PAUSED: 0 reboots in the last hour reach the limit of 0",
                     "RECONCILE REFUSING for equinix", "SHEPHERD_ASSIMILATE=true",
                     "1 work items held by 1 dead sessions"):
        assert expected in text, expected
    event = [line.strip() for line in text.splitlines() if "worker-machines died" in line]
    assert len(event) == 1 and re.fullmatch(
        r"\d\d:\d\d:\d\d worker-machines died \(status -9\); restarting in 2 s", event[0]), event
    assert "\x1b[31mdisk" not in raw  # the cause's own escapes never reach the terminal


def test_force_plain_on_a_terminal_and_a_pipe_give_plain_lines(db, fleet, terminal):
    shown = for_stream(terminal.slave, force_plain=True)
    shown.show(read_snapshot(db, NO_HTTP))
    shown.close()
    text = terminal.screen().replace("\r", "")
    assert "\x1b" not in text
    assert text.splitlines()[0].startswith(tuple(f"{h:02d}:" for h in range(24)))
    assert "machines 9  provided 9" in text
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "w") as pipe, os.fdopen(read_end) as back:
        shown = for_stream(pipe)
        shown.show(read_snapshot(db, NO_HTTP))
        shown.close()
        pipe.close()
        piped = back.read()
    assert "\x1b" not in piped and STAMP.match(piped)
