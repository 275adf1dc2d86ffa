"""Fault-tolerance harness: a fleet on the simulator (the e2e ``ControlPlane``), optionally
on its own throw-away PostgreSQL / Redis (so a scenario may restart them without
touching the servers other tests share), and ONE invariant check every scenario ends
with (``assert_invariants``).

    def test_x(fault_plane):  # the fixture is registered by tests/conftest.py
        cp = fault_plane(reservations=4, own_redis=True)
        ...inject one fault...
        report = assert_invariants(cp, machines=4)
        record_recovery("what happened", took, report)

``record_recovery`` keeps each scenario's recovery time and invariant summary for the
table printed at the end of the run (``pytest_terminal_summary`` below). It travels on
the test's report, so the table is whole when the tests ran in pytest-xdist workers.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest
import sqlalchemy as sa

import bmdb
from tests.support.celery_fixtures import ENDS, ControlPlane, dump, overlapping_work
from tests.support.servers import PostgresServer, RedisServer
from tests.support.waiting import wait_until

#: Short enough for bounded tests on 2 cores, long enough that nothing under test is
#: silent by accident: heartbeat thresholds are far above every fault's length, so
#: Recovery only runs where a scenario asks for it.
FAULT_ENV = {
    "SHEPHERD_FIRST_HEARTBEAT_TIMEOUT": "60",
    "SHEPHERD_HEARTBEAT_TIMEOUT": "60",
    "SHEPHERD_DISPATCH_TTL": "8",
}
RECEIVED = re.compile(r"Task (shepherd\.\w+)\[([0-9a-f-]{36})\] received")
SUCCEEDED = re.compile(r"Task (shepherd\.\w+)\[([0-9a-f-]{36})\] succeeded in [^:]+: (.*)$")
#: What Celery logs when a task asks to be retried (``self.retry``/``autoretry_for``).
RETRY_MARKERS = ("Retry in", " retry: ")
PER_MACHINE = ("shepherd.agent_start", "shepherd.recovery")
#: How late past a sweep period the beat's sweep may come (task latency on 2 cores, a
#: session passed over once by the sweep's SKIP LOCKED): the same slack as the
#: worker-kill scenario's release bound.
SWEEP_SLACK = 3.0

#: ``python -c HOLD_RECORDER -A tasks worker ...``: the ``celery`` command, with
#: ``bmdb.hold_singleton`` wrapped so that every hold a task *acquired* is written to
#: ``$FAULTS_HOLD_LOG`` ("<monotonic> <pid> acquired|releasing <name>", one short
#: O_APPEND write each, so lines of concurrent processes do not mix), and every refusal
#: too. Nothing else changes: "acquired" is written after the acquiring transaction
#: committed, "releasing" before the releasing one starts, so each recorded interval
#: lies inside the real hold and two recorded intervals of one name overlap only if
#: two holders really held it at once. Pool processes are forked from the patched
#: main process, and the product calls ``bmdb.hold_singleton(...)`` by attribute.
HOLD_RECORDER = """
import contextlib, os, sys, time
import bmdb

_hold, _path = bmdb.hold_singleton, os.environ["FAULTS_HOLD_LOG"]

def _note(event, name):
    fd = os.open(_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{time.monotonic():.6f} {os.getpid()} {event} {name}\\n".encode())
    finally:
        os.close(fd)

@contextlib.contextmanager
def hold(session, name, **waiting):
    with _hold(session, name, **waiting) as held:
        _note("acquired" if held else "refused", name)
        try:
            yield held
        finally:
            if held:
                _note("releasing", name)

bmdb.hold_singleton = hold
from celery.__main__ import main
sys.argv[0] = "celery"
main()
"""


class DeadSessionWatch:
    """Invariant 2 while the scenario runs: every ``every`` seconds, the work rows whose
    session is past its deadline, and how long past (by the database's clock).

    The sweep runs every sweep period, so no row may stay ``limit`` seconds past its
    session's deadline. Nobody can sweep while the database is down, and the workers
    find it again only at their next transaction retry, so after a database outage
    ages count from when the watch reached it again plus ``reconnect`` (the longest
    wait between BMDB transaction retries, ``bmdb._database.run_transaction``). Its own
    connection per look (no pool to go stale, no retries that would hide an outage).
    """

    def __init__(self, url: str, limit: float, every: float = 0.5,
                 reconnect: float = 2.0) -> None:
        self.limit, self.every, self.reconnect = limit, every, reconnect
        self.engine = sa.create_engine(url, poolclass=sa.pool.NullPool,
                                       connect_args={"connect_timeout": 2})
        self.longest = 0.0            # the longest a dead session's work was seen unswept
        self.seen: set[uuid.UUID] = set()
        self.looks = 0                # how many times it did read the work table
        self._violations: dict[uuid.UUID, str] = {}
        self._stop = threading.Event()
        #: Since when the database answers again after an outage (None: down now).
        self._back_at: dt.datetime | None = dt.datetime.min.replace(tzinfo=dt.UTC)
        self._thread = threading.Thread(target=self._run, name="dead-session-watch",
                                        daemon=True)

    def start(self) -> DeadSessionWatch:
        self._thread.start()
        return self

    @property
    def violations(self) -> list[str]:
        return list(self._violations.values())

    @property
    def watching(self) -> bool:
        return self._thread.is_alive() and self.looks > 0

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.engine.dispose()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.look()
            except Exception:  # down (restarting) or gone (teardown)
                self._back_at = None

    def look(self) -> None:
        w, s = bmdb._schema.work, bmdb._schema.sessions
        with self.engine.connect() as conn:
            now = bmdb.read_clock(conn)
            rows = conn.execute(sa.select(w.c.id, w.c.session_id, s.c.deadline)
                                .join(s, s.c.id == w.c.session_id)
                                .where(s.c.deadline <= now)).all()
        if self._back_at is None:
            self._back_at = now + dt.timedelta(seconds=self.reconnect)
        self.looks += 1
        for row in rows:
            self.seen.add(row.id)
            age = max(0.0, (now - max(row.deadline, self._back_at)).total_seconds())
            self.longest = max(self.longest, age)
            if age > self.limit:
                self._violations.setdefault(row.id, f"work {row.id} of session "
                                            f"{row.session_id}: {age:.1f}s past its "
                                            "deadline, not swept")


class FaultPlane(ControlPlane):
    """A ``ControlPlane`` that also knows its private servers (None: the shared ones)
    and watches for work of dead sessions from the start (``DeadSessionWatch``)."""

    pg_server: PostgresServer | None = None
    redis_server: RedisServer | None = None
    watch: DeadSessionWatch | None = None

    def close(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        super().close()

    def start_worker(self, node: str = "w1", concurrency: int = 2,
                     queues: str = "shepherd.control,shepherd.machines", *,
                     record_holds: bool = False) -> Any:
        """``ControlPlane.start_worker``; ``record_holds``: the same worker, recording
        its fleet-wide holds (``HOLD_RECORDER``, read back by ``holds()``)."""
        if not record_holds:
            return super().start_worker(node, concurrency, queues)
        return self.spawn(node, sys.executable, "-c", HOLD_RECORDER, "-A", "tasks",
                          "worker", "-Q", queues, "-c", str(concurrency), "-n",
                          f"{node}@%h", "--loglevel=INFO", "--without-gossip",
                          "--without-mingle", env={"FAULTS_HOLD_LOG": str(self.hold_log)})

    @property
    def hold_log(self) -> Path:
        return self.logs / "holds.txt"  # not *.log: ``all_logs`` reads Celery logs only

    def holds(self) -> list[tuple[float, int, str, str]]:
        """(monotonic time, pid, "acquired"/"releasing"/"refused", name) as recorded."""
        if not self.hold_log.exists():
            return []
        rows = []
        for line in self.hold_log.read_text().splitlines():
            at, pid, event, name = line.split(" ", 3)
            rows.append((float(at), int(pid), event, name))
        return rows

    @property
    def sweep_interval(self) -> float:
        return float(self.env["SHEPHERD_SWEEP_INTERVAL"])

    def start_second_beat(self) -> None:
        """A second ``celery beat`` on the same broker: the "started twice" mistake."""
        from tests.support.celery_fixtures import CELERY

        self.spawn("beat2", CELERY, "-A", "tasks", "beat", "--schedule",
                   str(self.tmp / "beat2-schedule"), "--loglevel=INFO")

    def work_rows(self) -> list[dict[str, Any]]:
        w = bmdb._schema.work
        return self.db.read(lambda tx: [dict(r._mapping) for r in tx.execute(sa.select(w))])

    def session_holders(self) -> dict[uuid.UUID, int]:
        """session id -> pid of the process holding it."""
        s = bmdb._schema.sessions
        return self.db.read(lambda tx: {r.id: int(r.holder.rsplit(":", 1)[1])
                                        for r in tx.execute(sa.select(s.c.id, s.c.holder))})

    def events(self, process: bmdb.Process | None = None, event: str | None = None,
               machine_id: uuid.UUID | None = None) -> list[dict[str, Any]]:
        return [h for h in self.history()
                if (process is None or h["process"] == process.value)
                and (event is None or h["event"] == event)
                and (machine_id is None or h["machine_id"] == machine_id)]

    def all_logs(self) -> dict[str, str]:
        return {path.stem: path.read_text(errors="replace")
                for path in sorted(Path(self.logs).glob("*.log"))}


@pytest.fixture
def fault_plane(tmp_path: Path, request: pytest.FixtureRequest
                ) -> Iterator[Callable[..., FaultPlane]]:
    """A factory: ``fault_plane(reservations=N, own_pg=False, own_redis=False, **env)``.

    ``own_pg`` / ``own_redis``: a function-scoped server for this test alone (the
    scenario restarts it); otherwise the session-wide ones, through ``pg_url`` /
    ``redis_url``.
    """
    made: list[FaultPlane] = []
    servers: list[PostgresServer | RedisServer] = []

    def make(reservations: int = 4, *, own_pg: bool = False, own_redis: bool = False,
             **env: str) -> FaultPlane:
        assert not made, "one control plane per test"
        pg = redis_ = None
        if own_pg:
            pg = PostgresServer().start()
            servers.append(pg)
            bmdb.connect(pg.url, migrate=True).close()
            pg_url = pg.url
        else:
            pg_url = request.getfixturevalue("pg_url")
        if own_redis:
            redis_ = RedisServer().start()
            servers.append(redis_)
            redis_url = redis_.url
        else:
            redis_url = request.getfixturevalue("redis_url")
        plane = FaultPlane(tmp_path, pg_url, redis_url, reservations=reservations,
                           env={**FAULT_ENV, **env})
        plane.pg_server, plane.redis_server = pg, redis_
        made.append(plane)
        plane.watch = DeadSessionWatch(pg_url, plane.sweep_interval + SWEEP_SLACK).start()
        return plane

    yield make
    for plane in made:
        plane.close()
    for server in servers:
        server.destroy()


# -- the invariants --------------------------------------------------------------------


@dataclass
class InvariantReport:
    """What the invariants saw (the end-of-run table, and ``pytest -s``)."""

    machines: int = 0
    events: Counter = field(default_factory=Counter)
    per_machine_tasks: int = 0
    redelivered: list[str] = field(default_factory=list)
    #: Work rows looked at, while the beat ran, for a dead session (there were none).
    work_checked: int = 0
    sessions_dead: int = 0            # sessions past their deadline at that moment
    #: From the watch over the whole run: dead sessions' work rows seen, and the
    #: longest one stayed past its session's deadline before the sweep released it.
    dead_work_seen: int = 0
    dead_work_longest: float = 0.0
    dead_work_limit: float = 0.0

    def columns(self) -> dict[str, str]:
        """The table's invariant columns (every one of them held, or no line at all)."""
        started = self.events.get(bmdb.Event.STARTED, 0)
        ends = ", ".join(f"{k} {v}" for k, v in sorted(self.events.items())
                         if k != bmdb.Event.STARTED)
        swept = (f"{self.dead_work_seen} swept in {self.dead_work_longest:.1f}s"
                 if self.dead_work_seen else "none")
        return {
            "machines": f"{self.machines} ok",
            "Started: all closed by": f"{started}: {ends}",
            "dead-session work": f"{swept} (limit {self.dead_work_limit:.0f}s), 0 left",
            "overlaps": "0",
            "Celery retries": "0",
            "redelivered": f"{len(self.redelivered)} of {self.per_machine_tasks} (gone)",
        }

    def __str__(self) -> str:
        return "; ".join(f"{k} {v}" for k, v in self.columns().items())


def dead_session_work(db: bmdb.BMDB, older_than: float = 0.0) -> list[dict[str, Any]]:
    """Work rows whose session is missing, or past its deadline by more than
    ``older_than`` seconds (by the database's clock)."""
    w, s = bmdb._schema.work, bmdb._schema.sessions

    def read(tx: bmdb.Tx) -> list[dict[str, Any]]:
        limit = tx.now - dt.timedelta(seconds=older_than)
        query = (sa.select(w.c.id, w.c.machine_id, w.c.process, w.c.session_id,
                           s.c.deadline)
                 .select_from(w.outerjoin(s, s.c.id == w.c.session_id))
                 .where(sa.or_(s.c.id.is_(None), s.c.deadline <= limit)))
        return [dict(r._mapping) for r in tx.execute(query)]

    return db.read(read)


def check_dead_session_work(cp: FaultPlane, report: InvariantReport) -> None:
    """Invariant 2, while the beat still runs its sweep: nothing the watch saw over the
    run (``DeadSessionWatch``) and, after one more sweep period (no sweep by hand), no
    work row of a session that died more than a sweep period (plus ``SWEEP_SLACK``)
    ago: the sweep should have released it by then."""
    assert "beat" in cp.processes, "the dead-session check needs the beat's sweep running"
    time.sleep(cp.sweep_interval)
    assert cp.watch is not None and cp.watch.watching, "the dead-session watch stopped"
    assert cp.watch.violations == [], "\n".join(cp.watch.violations)
    report.dead_work_seen, report.dead_work_longest = len(cp.watch.seen), cp.watch.longest
    report.dead_work_limit = cp.watch.limit
    stale = dead_session_work(cp.db, older_than=cp.sweep_interval + SWEEP_SLACK)
    assert stale == [], f"work of dead sessions, not swept: {dump(stale)}"
    s = bmdb._schema.sessions
    report.work_checked = len(cp.work_rows())
    report.sessions_dead = cp.db.read(lambda tx: int(tx.execute(
        sa.select(sa.func.count()).select_from(s).where(s.c.deadline <= tx.now)
    ).scalar_one()))


def overlapping_holds(holds: list[tuple[float, int, str, str]]) -> list[str]:
    """Fleet-wide holds (``FaultPlane.holds``) of one name held by two processes at once.

    Each process's "acquired" opens an interval that its next "releasing" of that name
    closes; one never closed (a process killed with it) stays open for good.
    """
    intervals: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    opened: dict[tuple[int, str], float] = {}
    for at, pid, event, name in sorted(holds):
        if event == "acquired":
            assert (pid, name) not in opened, f"{pid} acquired {name} twice"
            opened[(pid, name)] = at
        elif event == "releasing":
            intervals[name].append((opened.pop((pid, name)), at, pid))
    for (pid, name), at in opened.items():
        intervals[name].append((at, math.inf, pid))
    problems = []
    for name, spans in intervals.items():
        held_until, holder = -math.inf, None
        for start, end, pid in sorted(spans):
            if start < held_until:
                problems.append(f"{name}: pid {pid} acquired it at {start:.3f} while pid "
                                f"{holder} held it (until {held_until:.3f})")
            if end > held_until:
                held_until, holder = end, pid
    return problems


def api_request_bound(window: float, processes: int) -> int:
    """The most provider API requests ``processes`` worker processes can send in
    ``window`` seconds of an API that answers every call with an error, if the client
    waits between attempts as its retry policy says (``ClientConfig``'s defaults: the
    runtime passes only ``min_interval``/``max_in_flight``, from settings with the same
    defaults, which the scenarios keep).

    A pool process runs one task at a time and a task makes its calls one after the
    other, so a process has one call in flight at most; the beat only queues more tasks.
    A call that keeps failing makes ``retries + 1`` requests separated by waits that add
    up to at least ``span`` (exponential from ``backoff_initial``, capped at
    ``backoff_max``; the jitter only adds), so at most ``window // span`` calls fit
    wholly inside the window, plus one cut by each end. The rate limiter
    (``min_interval`` between call starts) gives the other bound.
    """
    from shepherd.providers.equinix import ClientConfig

    config = ClientConfig(token="-", project_id="-")
    span = sum(min(config.backoff_max, config.backoff_initial * 2 ** n)
               for n in range(config.retries))
    by_retries = (config.retries + 1) * (math.floor(window / span) + 2)
    by_limiter = math.floor(window / config.min_interval) + 1
    return processes * min(by_retries, by_limiter)


def unclosed_work(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``Started`` rows with no ``Finished``/``Failed``/``Canceled``/``Abandoned`` of the
    same work id after them."""
    closed = {h["work_id"] for h in history if h["event"] in ENDS}
    return [h for h in history if h["event"] == bmdb.Event.STARTED
            and h["work_id"] not in closed]


def celery_retries(logs: dict[str, str], *, redelivery_ok: bool = False
                   ) -> tuple[list[str], int, list[str]]:
    """(problems, per-machine task ids seen, ids delivered more than once).

    No task may be retried by Celery (failures are BMDB backoffs). A per-machine task id
    received twice is a *redelivery* (the broker giving back the message of a worker
    process that died under it); that is allowed only where the scenario kills a worker
    (``redelivery_ok``), and then every extra delivery must end as ``gone``, i.e. it
    touched nothing.
    """
    problems = [f"{name}: {line}" for name, text in logs.items() for line in text.splitlines()
                if any(marker in line for marker in RETRY_MARKERS)]
    received: Counter[str] = Counter()
    outcomes: dict[str, list[str]] = defaultdict(list)
    for text in logs.values():
        for line in text.splitlines():
            if (m := RECEIVED.search(line)) and m.group(1) in PER_MACHINE:
                received[m.group(2)] += 1
            elif (m := SUCCEEDED.search(line)) and m.group(1) in PER_MACHINE:
                outcomes[m.group(2)].append(m.group(3))
    twice = [task for task, n in received.items() if n > 1]
    for task in twice:
        if not redelivery_ok:
            problems.append(f"task {task} was received {received[task]} times")
        elif not all("'outcome': 'gone'" in result for result in outcomes[task]):
            problems.append(f"redelivered task {task} did work again: {outcomes[task]}")
    return problems, len(received), twice


def settle(cp: FaultPlane, timeout: float = 30.0) -> None:
    """Stop the beats (no new claims), then wait until no work is held or claimed.

    Why: "every Started is closed" can only be checked once nothing is in flight; the
    workers stay up, so in-flight work ends the normal way.
    """
    for name in ("beat", "beat2"):
        cp.stop(name)

    def drained() -> bool:
        cp.db.sweep()
        return not cp.work_rows()

    wait_until(drained, timeout, "all work released after stopping beat", cp, every=0.5)


def assert_invariants(cp: FaultPlane, *, machines: int,
                      expect: Callable[[uuid.UUID, dict[str, Any]], bool] | None = None,
                      redelivery_ok: bool = False, recovery_expected: bool = False
                      ) -> InvariantReport:
    """The checks every scenario ends with; beats are stopped here (see ``settle``).

    1. every machine reaches the state it should (``expect(machine_id, tags)``; by
       default AgentStarted), and exactly ``machines`` machines exist in the BMDB and
       at the provider, one device per reservation (nothing created twice);
    2. no work item belongs to a dead session: checked first, while the beat runs
       (``check_dead_session_work``), and again after the final sweep;
    3. every ``Started`` is closed by ``Finished``/``Failed``/``Canceled``/``Abandoned``;
    4. no two work items of one exclusion group overlapped on a machine;
    5. no Celery task was retried by Celery (see ``celery_retries``);
    and the workers are still running, and no Recovery ran unless expected.
    """
    cp.assert_running()
    report = InvariantReport()
    check_dead_session_work(cp, report)
    settle(cp)
    # 1. end state, nothing twice
    ids = cp.machine_ids()
    report.machines = len(ids)
    assert len(ids) == machines, f"{len(ids)} machines in the BMDB, expected {machines}"
    devices = [d for d in cp.simulator.devices.values() if d.created_by == "api"]
    assert len(devices) == machines, f"{len(devices)} devices at the provider"
    reservations = Counter(d.reservation_id for d in devices)
    assert all(n == 1 for n in reservations.values()), reservations
    check = expect or (lambda _id, tags: "AgentStarted" in tags)
    wrong = {str(i): sorted(tags) for i in ids if not check(i, tags := cp.tags(i))}
    assert not wrong, f"machines not in the expected state: {dump(wrong)}"
    # 2. nothing owned by the dead
    cp.db.sweep()
    assert dead_session_work(cp.db) == []
    # 3. every Started closed; 4. no overlap
    history = cp.history()
    report.events = Counter(h["event"] for h in history)
    assert unclosed_work(history) == [], dump(unclosed_work(history))
    assert overlapping_work(history) == []
    if not recovery_expected:
        recovery = [h for h in history if h["process"] == bmdb.Process.RECOVERY.value]
        assert recovery == [], dump(recovery)
    # 5. no Celery retries
    problems, report.per_machine_tasks, report.redelivered = celery_retries(
        cp.all_logs(), redelivery_ok=redelivery_ok)
    assert problems == [], "\n".join(problems)
    return report


#: A scenario's line in the end-of-run table: column -> text, and its notes. Plain
#: strings only, since the line travels from an xdist worker on the test's report.
Recovery = dict[str, Any]
#: The report's user property that carries a ``Recovery``.
RECOVERY_PROPERTY = "fault_recovery"
#: Scenarios recorded by the test now running, not yet put on its report.
_RECORDED: list[Recovery] = []
#: Every scenario that passed its checks in this run, in order (``fault_summary``).
RECOVERIES: list[Recovery] = []


def record_recovery(name: str, took: float, report: InvariantReport, *notes: str) -> None:
    """Keep how long recovery took since the fault ended and what the invariants saw,
    for the table at the end of the run (and say it now, for ``pytest -s``)."""
    _RECORDED.append({"columns": {"scenario": name, "recovered": f"{took:.1f}s",
                                  **report.columns()}, "notes": list(notes)})
    extra = "".join(f"; {note}" for note in notes)
    print(f"\n[faults] {name}: recovered {took:.1f}s after the fault ended; invariants "
          f"hold: {report}{extra}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if call.when == "call":
        report.user_properties.extend((RECOVERY_PROPERTY, r) for r in _RECORDED)
        _RECORDED.clear()
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    RECOVERIES.extend(cast(Recovery, value) for name, value in report.user_properties
                      if name == RECOVERY_PROPERTY)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter,
                            config: pytest.Config) -> None:
    """The fault scenarios' recovery times and invariant summaries, as a short table
    (in the process that reports: not in an xdist worker)."""
    if RECOVERIES and not hasattr(config, "workerinput"):
        terminalreporter.write_sep("=", "fault scenarios: recovery after the fault ended")
        fault_summary(terminalreporter.write_line)


def fault_summary(write_line: Callable[[str], None]) -> None:
    """One line per scenario that passed, its notes under it."""
    rows = [r["columns"] for r in RECOVERIES]
    widths = {k: max(len(k), *(len(row[k]) for row in rows)) for k in rows[0]}
    write_line("  ".join(f"{k:<{w}}" for k, w in widths.items()).rstrip())
    for r, row in zip(RECOVERIES, rows, strict=True):
        write_line("  ".join(f"{row[k]:<{w}}" for k, w in widths.items()).rstrip())
        for note in r["notes"]:
            write_line(f"{'':<{widths['scenario']}}  {note}")
