"""Fault-tolerance harness: a fleet on the simulator (the e2e ``ControlPlane``), optionally
on its own throw-away PostgreSQL / Redis (so a scenario may restart them without
touching the servers other tests share), and ONE invariant check every scenario ends
with (``assert_invariants``).

    from tests.fault_fixtures import fault_plane  # noqa: F401

    def test_x(fault_plane):
        cp = fault_plane(reservations=4, own_redis=True)
        ...inject one fault...
        report = assert_invariants(cp, expect_agent_started=True)
"""

from __future__ import annotations

import re
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import bmdb
from tests.celery_fixtures import ENDS, ControlPlane, dump, overlapping_work, wait_until
from tests.servers import PostgresServer, RedisServer

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


class FaultPlane(ControlPlane):
    """A ``ControlPlane`` that also knows its private servers (None: the shared ones)."""

    pg_server: PostgresServer | None = None
    redis_server: RedisServer | None = None

    def start_second_beat(self) -> None:
        """A second ``celery beat`` on the same broker: the "started twice" mistake."""
        from tests.celery_fixtures import CELERY

        self.spawn("beat2", CELERY, "-A", "tasks", "beat", "--schedule",
                   str(self.tmp / "beat2-schedule"), "--loglevel=INFO")

    def work_rows(self) -> list[dict[str, Any]]:
        w = bmdb.schema.work
        return self.db.read(lambda tx: [dict(r._mapping) for r in tx.execute(sa.select(w))])

    def session_holders(self) -> dict[uuid.UUID, int]:
        """session id -> pid of the process holding it."""
        s = bmdb.schema.sessions
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
        return plane

    yield make
    for plane in made:
        plane.close()
    for server in servers:
        server.destroy()


# -- the invariants --------------------------------------------------------------------


@dataclass
class InvariantReport:
    """What the invariants saw, printed by each scenario (``pytest -s``)."""

    machines: int = 0
    events: Counter = field(default_factory=Counter)
    per_machine_tasks: int = 0
    redelivered: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        events = ", ".join(f"{k}={v}" for k, v in sorted(self.events.items()))
        return (f"{self.machines} machines; history {events}; {self.per_machine_tasks} "
                f"per-machine task ids; redelivered (ended 'gone'): {len(self.redelivered)}")


def dead_session_work(cp: ControlPlane) -> list[dict[str, Any]]:
    """Work rows whose session is missing or past its deadline."""
    w, s = bmdb.schema.work, bmdb.schema.sessions

    def read(tx: bmdb.Tx) -> list[dict[str, Any]]:
        query = (sa.select(w.c.id, w.c.machine_id, w.c.process, w.c.session_id,
                           s.c.deadline)
                 .select_from(w.outerjoin(s, s.c.id == w.c.session_id))
                 .where(sa.or_(s.c.id.is_(None), s.c.deadline <= tx.now)))
        return [dict(r._mapping) for r in tx.execute(query)]

    return cp.db.read(read)


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
    2. no work item belongs to a dead session after a final sweep;
    3. every ``Started`` is closed by ``Finished``/``Failed``/``Canceled``/``Abandoned``;
    4. no two work items of one exclusion group overlapped on a machine;
    5. no Celery task was retried by Celery (see ``celery_retries``);
    and the workers are still running, and no Recovery ran unless expected.
    """
    cp.assert_running()
    settle(cp)
    report = InvariantReport()
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
    assert dead_session_work(cp) == []
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


def print_recovery(name: str, took: float, report: InvariantReport) -> None:
    """Say (``pytest -s``) how long recovery took since the fault ended, and what held."""
    print(f"\n[faults] {name}: recovered {took:.1f}s after the fault ended; invariants "
          f"hold: {report}")
