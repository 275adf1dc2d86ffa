"""Every periodic and operator path at 10k, 100k and 1M machines (issue 14's proof).

One PostgreSQL database holds a fleet in the issue's shape, grown between sizes with
set-based SQL through the real tables (so the BMDB's triggers run): nearly every
machine Provided, AgentStarted and heartbeating; a few hundred awaiting AgentStart; a
few hundred silent (gone quiet, or never heard from); 1 % in maintenance; a few
backoffs and work items of a live session; 3 history rows per machine, and a few
Recovery starts within the last hour. After the largest size, history is grown to
``--history-rows`` for one more run.

Each path is timed ``--runs`` times after one warm-up run (median, ms). HTTP paths go
through a real callback server on loopback (``shepherd.server.start_server``), the
CLI is a subprocess, the updater runs in a fresh process so its peak memory growth
(``ru_maxrss``) is its own. Printed: a markdown table with the 1M/10k growth factor,
and which of the issues' aims each path misses (growth <= 1.5x for HTTP paths, issue
32's, and <= 2x for the others, but for the updater, which compares every machine;
HTTP paths and the guard <= 50 ms at 1M; the updater <= 2 s and <= 100 MB at 1M; the
CLI <= 300 ms at 10k, next to its floor: any Python process that imports SQLAlchemy
and reads 500 rows). About 7-10 minutes on a
loaded 2-core machine, most of it building the 1M fleet and its 10M history rows.

    .venv/bin/python -m bench.scale [--pg-url URL] [--sizes 10000,100000,1000000]
        [--history-rows 10000000] [--runs 5] [--quick] [--paths guard,updater,...]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import datetime as dt
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import requests
import sqlalchemy as sa
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import bmdb
from bench.common import arguments, postgres
from bmdb import Event, Process
from shepherd.agent.protocol import (
    HEADER_MACHINE,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    HEARTBEAT_PATH,
    signing_payload,
)
from shepherd.cli.serve import operator_api
from shepherd.config import Settings
from shepherd.operations import tokens
from shepherd.providers.base import Capacity, ProviderMachine
from shepherd.roles import Role
from shepherd.runtime import Runtime
from shepherd.server import RunningServer, ServeOptions, start_server
from shepherd.server.options import COMPONENT
from shepherd.workflows import guard, sourcing, updater
from shepherd.workflows.guard import GuardLimits
from tests.support.servers import free_port

PROVIDER = "bench"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Machines are numbered 1..N; their ids, provider ids and addresses follow from the
#: number, so SQL and the updater's listing agree without reading each other.
EPOCH = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
SESSION_ID = uuid.UUID(hashlib.md5(b"bench-session").hexdigest())
ISSUE_SIZES = (10_000, 100_000, 1_000_000)
LARGE = 1_000_000


# -- the fleet --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """Which machines (by number, from 1) are special; every other one heartbeats.

    In order: ``awaiting`` machines have no agent yet (the first ``start_backoffs``
    of them back off, the next ``start_work`` are held by AgentStart); then ``quiet``
    ones went silent a day ago (the first ``recovery_backoffs`` back off after a
    Recovery start within the last hour, the next ``recovery_work`` are held by
    Recovery); then ``never`` ones never sent a heartbeat. Past those, every
    ``held_every``-th machine is in maintenance.
    """

    awaiting: int = 300
    quiet: int = 200
    never: int = 100
    start_backoffs: int = 20
    start_work: int = 10
    recovery_backoffs: int = 10
    recovery_work: int = 5
    held_every: int = 100

    @classmethod
    def for_fleet(cls, smallest: int) -> Shape:
        """The issue's shape from 10k machines up; scaled down below (a smoke run), so
        the silent share stays 3 % and the guard lets Recovery claim."""
        factor = min(1.0, smallest / 10_000)
        default = cls()
        return cls(**{name: max(1, round(getattr(default, name) * factor))
                      for name in ("awaiting", "quiet", "never", "start_backoffs", "start_work",
                                   "recovery_backoffs", "recovery_work")})

    @property
    def silent_end(self) -> int:
        return self.awaiting + self.quiet + self.never

    @property
    def probe(self) -> int:
        """The machine the heartbeat path sends for (an ordinary heartbeating one)."""
        return self.silent_end + 1

    @property
    def shown(self) -> int:
        """The machine whose page is timed."""
        return self.silent_end + 2

    def bounds(self) -> dict[str, int]:
        a, q = self.awaiting, self.awaiting + self.quiet
        return {"a": a, "q": q, "v": self.silent_end, "ab": self.start_backoffs,
                "aw": self.start_backoffs + self.start_work, "rb": a + self.recovery_backoffs,
                "rw": a + self.recovery_backoffs + self.recovery_work,
                "held_every": self.held_every}


def machine_id(n: int) -> uuid.UUID:
    """Machine ``n``'s id: what ``md5('bench-' || n)::uuid`` gives in SQL."""
    return uuid.UUID(hashlib.md5(f"bench-{n}".encode()).hexdigest())


def address(n: int) -> str:
    """Machine ``n``'s address, as the SQL below writes it (n < 2**24)."""
    return f"10.{n >> 16}.{(n >> 8) & 255}.{n & 255}"


SERIES = "FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS n"
ID = "md5('bench-' || n)::uuid"
ADDRESS = "'10.' || (n / 65536) || '.' || mod(n / 256, 256) || '.' || mod(n, 256)"
QUIET = "n > %(a)s AND n <= %(q)s"
NEVER = "n > %(q)s AND n <= %(v)s"

#: Per chunk of machine numbers: the rows every machine has, by its number.
MACHINE_ROWS = [
    f"INSERT INTO machines (id, created_at) SELECT {ID}, %(epoch)s + n * interval '1 second' "
    f"{SERIES}",
    "INSERT INTO provided (machine_id, provider, provider_id, address, location, "
    "provider_status, updated_at, agent_started) "
    f"SELECT {ID}, %(provider)s, 'bench-' || n, {ADDRESS}, 'rack-' || mod(n, 50), "
    f"%(running)s, %(epoch)s + n * interval '1 second', n > %(a)s {SERIES}",
    "INSERT INTO agent_started (machine_id, started_at, public_key, nonce, heartbeat_seen) "
    f"SELECT {ID}, now() - interval '2 days', %(key)s, 'bench', NOT ({NEVER}) {SERIES} "
    "WHERE n > %(a)s",
    # Heartbeats stamped ahead: the fleet stays fresh however long the run takes.
    "INSERT INTO agent_heartbeat (machine_id, last_heartbeat_at, last_signed_at) "
    f"SELECT {ID}, CASE WHEN {QUIET} THEN now() - interval '1 day' "
    "ELSE now() + interval '6 hours' END, now() - interval '1 day' "
    f"{SERIES} WHERE n > %(a)s AND NOT ({NEVER})",
    # Every machine that heartbeated sent its hardware report: the hostname column
    # written beside it, as ``bmdb.tags.set_hardware_report`` does.
    "INSERT INTO hardware_report (machine_id, reported_at, report, hostname) "
    f"SELECT {ID}, now() - interval '1 day', replace(%(report)s, '@host@', 'bench-' || n)::json, "
    f"'bench-' || n {SERIES} WHERE n > %(a)s AND NOT ({NEVER})",
    "INSERT INTO machine_holds (machine_id, kind, reason, actor, since) "
    f"SELECT {ID}, 'maintenance', 'bench: planned work', 'bench', now() {SERIES} "
    "WHERE n > %(v)s AND mod(n, %(held_every)s) = 0",
]

#: The few special rows, once, after the first machines exist.
SPECIAL_ROWS = [
    "INSERT INTO sessions (id, component, holder, started_at, interval_s, deadline) "
    "VALUES (%(session)s, 'bench-fleet', 'bench', now(), 5, now() + interval '1 day')",
    "INSERT INTO backoff (machine_id, process, until, interval_s, cause, updated_at) "
    f"SELECT {ID}, CASE WHEN n <= %(a)s THEN %(agent_start)s ELSE %(recovery)s END, "
    f"now() + interval '1 day', 300, 'bench: failed', now() {SERIES} "
    "WHERE n <= %(ab)s OR (n > %(a)s AND n <= %(rb)s)",
    "INSERT INTO work (id, machine_id, process, exclusion_group, session_id, started_at) "
    f"SELECT md5('bench-work-' || n)::uuid, {ID}, "
    "CASE WHEN n <= %(a)s THEN %(agent_start)s ELSE %(recovery)s END, "
    "CASE WHEN n <= %(a)s THEN %(start_group)s ELSE %(recovery_group)s END, "
    f"%(session)s, now() {SERIES} "
    "WHERE (n > %(ab)s AND n <= %(aw)s) OR (n > %(rb)s AND n <= %(rw)s)",
]

#: History rows: one per (machine, pattern entry), work ids shared within a group.
HISTORY_ROWS = (
    "INSERT INTO history (machine_id, process, event, at, work_id) "
    f"SELECT {ID}, k.process, k.event, CASE WHEN %(recent)s "
    "THEN now() - interval '30 minutes' + k.i * interval '1 second' "
    "ELSE %(epoch)s + n * interval '1 second' + (%(offset)s + k.i) * interval '1 hour' END, "
    "CASE WHEN k.work IS NOT NULL THEN md5('bench-w' || k.work || '-' || n)::uuid END "
    f"{SERIES} CROSS JOIN unnest(%(processes)s::text[], %(events)s::text[], "
    "%(works)s::int[]) WITH ORDINALITY AS k(process, event, work, i) "
    "WHERE n >= %(first)s AND n <= %(last)s"
)

#: A hardware report in the agent's shape (``shepherd.agent.agent.hardware_report``) of an
#: ordinary server; ``@host@`` is each machine's hostname.
REPORT = json.dumps({
    "hostname": "@host@",
    "cpu": {"model": "Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz", "sockets": 2, "cores": 64,
            "threads": 128},
    "memory_bytes": 512 * 1024 ** 3,
    "block_devices": [{"name": f"nvme{i}n1", "size_bytes": 3840755982336,
                       "rotational": False} for i in range(2)],
    "network_interfaces": [{"name": f"eno{i}", "mac": f"b4:96:91:00:00:0{i}"}
                           for i in range(1, 3)],
    "installation": None,
    "warnings": [],
})

Pattern = Sequence[tuple[str, str, int | None]]
#: Every machine's own three rows: its takeover, and the host key pinned during it.
BASE_HISTORY: Pattern = [(Process.AGENT_START.value, Event.STARTED, 1),
                         (bmdb.Topic.HOST_KEY, bmdb.Event.PINNED, None),
                         (Process.AGENT_START.value, Event.FINISHED, 1)]
#: What older history adds per machine, cycled: Recovery runs and takeovers.
EXTRA_HISTORY: Pattern = [(Process.RECOVERY.value, Event.STARTED, 2),
                          (Process.RECOVERY.value, bmdb.Event.RUNG, 2),
                          (Process.RECOVERY.value, Event.FINISHED, 2),
                          (Process.AGENT_START.value, Event.STARTED, 3),
                          (Process.AGENT_START.value, Event.FINISHED, 3),
                          (Process.RECOVERY.value, Event.STARTED, 4),
                          (Process.RECOVERY.value, Event.FAILED, 4)]
#: The Recovery starts within the last hour (they spend the guard's hourly budget).
RECENT_HISTORY: Pattern = [(Process.RECOVERY.value, Event.STARTED, 9),
                           (Process.RECOVERY.value, Event.FAILED, 9)]


def _values(shape: Shape, lo: int, hi: int) -> dict[str, Any]:
    return {"lo": lo, "hi": hi, "epoch": EPOCH, "provider": PROVIDER,
            "running": bmdb.ProviderStatus.RUNNING.value, "key": bytes(32), "report": REPORT,
            "session": str(SESSION_ID), "agent_start": Process.AGENT_START.value,
            "recovery": Process.RECOVERY.value,
            "start_group": bmdb.exclusion_group(Process.AGENT_START),
            "recovery_group": bmdb.exclusion_group(Process.RECOVERY), **shape.bounds()}


def _history(conn: sa.Connection, values: dict[str, Any], pattern: Pattern, *,
             offset: int = 0, first: int = 1, last: int | None = None,
             recent: bool = False) -> None:
    processes, events, works = (list(column) for column in zip(*pattern, strict=True))
    conn.exec_driver_sql(HISTORY_ROWS, {
        **values, "processes": processes, "events": events, "works": works,
        "offset": offset, "first": first, "last": values["hi"] if last is None else last,
        "recent": recent})


def grow_fleet(engine: sa.Engine, old: int, new: int, shape: Shape = Shape(),
               chunk: int = 100_000) -> None:
    """Machines ``old + 1`` to ``new``, in the shape, a transaction per ``chunk``.

    Why chunks: a bounded transaction per step whatever the size, and triggers
    never see millions of rows in one transaction. Each tag row's trigger rewrites
    its machine's row (``tag_bits``), so ``machines`` is vacuumed after each chunk:
    the next one reuses that space, and the table ends about as dense as a fleet's
    that autovacuum kept up with, not five row versions per machine.
    """
    for lo in range(old + 1, new + 1, chunk):
        values = _values(shape, lo, min(new, lo + chunk - 1))
        with engine.begin() as conn:
            for statement in MACHINE_ROWS:
                conn.exec_driver_sql(statement, values)
            _history(conn, values, BASE_HISTORY)
        vacuum(engine, "machines")
    if old == 0:
        with engine.begin() as conn:
            _special_rows(conn, _values(shape, 1, min(new, shape.silent_end)), shape)


def _special_rows(conn: sa.Connection, values: dict[str, Any], shape: Shape) -> None:
    for statement in SPECIAL_ROWS:
        conn.exec_driver_sql(statement, values)
    bounds = shape.bounds()
    _history(conn, values, RECENT_HISTORY, first=bounds["a"] + 1, last=bounds["rb"],
             recent=True)


def grow_history(engine: sa.Engine, size: int, per_machine: int,
                 chunk: int = 100_000) -> None:
    """``per_machine`` more (older) history rows for each of machines 1 to ``size``."""
    pattern = list(itertools.islice(itertools.cycle(EXTRA_HISTORY), per_machine))
    for lo in range(1, size + 1, chunk):
        values = _values(Shape(), lo, min(size, lo + chunk - 1))
        with engine.begin() as conn:
            _history(conn, values, pattern, offset=len(BASE_HISTORY))


@contextlib.contextmanager
def indexes_rebuilt(engine: sa.Engine, table: str) -> Iterator[None]:
    """Drop ``table``'s secondary indexes for a bulk load, and create them again after.

    Why: millions of random inserts into four B-trees were most of the build's time
    (history at 1M machines); one sort per index afterwards costs a fraction. The
    primary key and every constraint stay, the triggers run as ever; the rebuilt
    indexes are only denser than ones grown row by row.
    """
    with engine.begin() as conn:
        indexes = conn.exec_driver_sql(
            "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = current_schema() "
            "AND tablename = %(table)s AND indexname NOT IN (SELECT conname FROM pg_constraint)",
            {"table": table}).all()
        for name, _ in indexes:
            conn.exec_driver_sql(f'DROP INDEX "{name}"')
    try:
        yield
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql("SET LOCAL maintenance_work_mem = '512MB'")
            for _, definition in indexes:
                conn.exec_driver_sql(definition)


def vacuum(engine: sa.Engine, table: str = "") -> None:
    """VACUUM ANALYZE (one table, or all), then a CHECKPOINT: statistics, visibility
    and a disk at rest, as a fleet that lived a while has. Without the checkpoint the
    paths timed first after a build of 1M machines competed with PostgreSQL writing
    out gigabytes of it (the guard's read took 13 ms, then 5 ms once written)."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql(f"VACUUM ANALYZE {table}".strip())
        conn.exec_driver_sql("CHECKPOINT")


def set_probe_key(engine: sa.Engine, n: int, public: bytes, nonce: str) -> None:
    """Give machine ``n``'s AgentStarted a real key, so signed heartbeats verify."""
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "UPDATE agent_started SET public_key = %(key)s, nonce = %(nonce)s "
            "WHERE machine_id = %(id)s", {"key": public, "nonce": nonce, "id": str(machine_id(n))})


# -- the provider's listing ---------------------------------------------------------------------


def listed(n: int, moved_to: str | None = None) -> ProviderMachine:
    """Machine ``n`` as the provider lists it: as the fleet's rows say, or at
    ``moved_to``."""
    return ProviderMachine(provider_id=f"bench-{n}", address=moved_to or address(n),
                           ssh_port=22, location=f"rack-{n % 50}", reservation_id=None,
                           status=bmdb.ProviderStatus.RUNNING, failed=False)


class Listing(Sequence[ProviderMachine]):
    """Machines 1..N as the provider lists them, each made on access."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    @overload
    def __getitem__(self, index: int) -> ProviderMachine: ...

    @overload
    def __getitem__(self, index: slice) -> list[ProviderMachine]: ...

    def __getitem__(self, index: int | slice) -> ProviderMachine | list[ProviderMachine]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.size))]
        if not -self.size <= index < self.size:
            raise IndexError(index)
        return listed(index % self.size + 1)

    def __iter__(self) -> Iterator[ProviderMachine]:
        return (self[i] for i in range(self.size))


@dataclass
class BenchProvider:
    """A provider whose listing (``Listing``, or a list made of one) matches the fleet
    exactly: nothing changed."""

    machines: Sequence[ProviderMachine]
    name: str = PROVIDER
    authoritative: bool = False

    def list_machines(self) -> Sequence[ProviderMachine]:
        return self.machines

    def get_machine(self, provider_id: str) -> ProviderMachine:
        return self.machines[int(provider_id.removeprefix("bench-")) - 1]

    def list_capacity(self) -> list[Capacity]:
        return []

    def create_machine(self, capacity: Capacity) -> ProviderMachine:
        raise NotImplementedError("the bench fleet is fixed")

    def reboot(self, provider_id: str) -> None:
        raise NotImplementedError("the bench fleet is fixed")


# -- timing ---------------------------------------------------------------------------------------

#: A timed step; what it returns (if anything) is run after the clock stops.
Step = Callable[[], Callable[[], None] | None]


@dataclass
class Timing:
    """A path's runs at one size (ms); ``mb``: peak memory growth, where measured."""

    runs: list[float]
    mb: float | None = None
    #: Why the path could not be timed (it raised), or None.
    error: str | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.runs) if self.runs else math.nan


def measure(step: Step, runs: int, budget: float, least: int = 3) -> Timing:
    """One warm-up, then ``runs`` timed runs; fewer (but ``least``) once ``budget``
    seconds are spent, so a slow baseline still finishes."""
    _run(step)
    spent = 0.0
    times: list[float] = []
    while len(times) < runs and (len(times) < least or spent < budget):
        took = _run(step)
        times.append(took * 1000)
        spent += took
    return Timing(times)


def _run(step: Step) -> float:
    started = time.perf_counter()
    cleanup = step()
    took = time.perf_counter() - started
    if cleanup is not None:
        cleanup()
    return took


# -- the paths ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Path:
    key: str
    label: str
    http: bool = False


#: How much a path may grow from the smallest fleet to the largest: HTTP paths by issue
#: 32's aim, the others by issue 14's.
HTTP_GROWTH, GROWTH = 1.5, 2

PATHS = [
    Path("guard", "blast-radius guard (`guard.decide`)"),
    Path("metrics", "BMDB metrics scrape (`GET /metrics`)", http=True),
    Path("machines", "`GET /machines` (500 rows)", http=True),
    Path("without", "`GET /machines?without=AgentHeartbeat`", http=True),
    Path("byname", "`GET /machines?sort=name` (500 rows, rack order)", http=True),
    Path("api", "`GET /api/v1/machines` (500 rows, JSON, a viewer's token)", http=True),
    Path("machine", "machine page with explain", http=True),
    Path("recovery", "Recovery sourcing, minus Celery"),
    Path("updater", "updater, nothing changed"),
    Path("sweep", "sweep"),
    Path("claims", "AgentStart claim of 20, then release"),
    Path("heartbeat", "one signed heartbeat (`POST`)", http=True),
    Path("cli", "CLI: `shepherd machines` (wall time)"),
    Path("floor", "its floor: a new process, SQLAlchemy + psycopg2, 500 rows (wall time)"),
]


@dataclass
class Bench:
    """What the paths run against: the BMDB, a callback server, a session, a probe agent."""

    url: str
    db: bmdb.BMDB
    server: RunningServer
    session: bmdb.Session
    limits: GuardLimits
    shape: Shape
    key: Ed25519PrivateKey = field(default_factory=Ed25519PrivateKey.generate)
    nonce: str = field(default_factory=lambda: base64.b64encode(os.urandom(32)).decode())
    http: requests.Session = field(default_factory=requests.Session)
    #: A viewer's token for the operators' API.
    token: str = ""

    def steps(self) -> dict[str, Step]:
        base = self.server.url
        shown = machine_id(self.shape.shown)
        return {
            "guard": self.guard,
            "metrics": lambda: self.get(f"{base}/metrics"),
            "machines": lambda: self.get(f"{base}/machines?limit=500"),
            "without": lambda: self.get(f"{base}/machines?without=AgentHeartbeat&limit=500"),
            "byname": lambda: self.get(f"{base}/machines?sort=name&limit=500"),
            "api": lambda: self.get(f"{base}/api/v1/machines?limit=500",
                                    Authorization=f"Bearer {self.token}"),
            "machine": lambda: self.get(f"{base}/machines/{shown}"),
            "recovery": self.recovery,
            "sweep": self.sweep,
            "claims": self.claims,
            "heartbeat": self.heartbeat,
            "cli": self.cli,
            "floor": self.floor,
        }

    def get(self, url: str, **headers: str) -> None:
        response = self.http.get(url, timeout=600, headers=headers)
        if response.status_code != 200:
            raise RuntimeError(f"GET {url}: {response.status_code} {response.text[:200]}")

    def guard(self) -> None:
        self.db.read(lambda tx: guard.decide(tx, self.db.thresholds, GuardLimits(), None))

    def sweep(self) -> None:
        self.db.sweep()

    def recovery(self) -> Callable[[], None]:
        claimed: list[bmdb.Work] = []
        outcome = sourcing.source(self.session, Process.RECOVERY, sourcing.SourcingSettings(),
                                  self.limits, claimed.append)
        if not outcome.get("claimed"):
            raise RuntimeError(f"Recovery sourcing claimed nothing: {outcome}")
        return lambda: _cancel(claimed)

    def _past_the_grace(self) -> None:
        """The probe's heartbeat made the bench's server record that heartbeats resumed,
        and within one heartbeat timeout of that no machine counts as silent
        (``bmdb.resumptions``). The next size's Recovery path measures a sourcing with
        silent machines to claim, as a fleet has outside that grace: so the record is
        moved back a day, after the heartbeat and outside its timing."""
        with self.db.engine.begin() as conn:
            conn.exec_driver_sql("UPDATE resumptions SET at = at - interval '1 day'")

    def claims(self) -> Callable[[], None]:
        claimed = self.session.claim_backlog(Process.AGENT_START, 20, dispatch_ttl=120)
        if not claimed:
            raise RuntimeError("the AgentStart claim found nothing")
        return lambda: _cancel(claimed)

    def heartbeat(self) -> Callable[[], None]:
        request = signed_heartbeat(self.key, self.nonce, machine_id(self.shape.probe))
        response = requests.post(f"{self.server.url}{HEARTBEAT_PATH}", **request, timeout=60)
        if response.status_code != 200:
            raise RuntimeError(f"heartbeat: {response.status_code} {response.text[:200]}")
        return self._past_the_grace

    def cli(self) -> None:
        """``shepherd machines`` as an operator runs it: the installed script, a new
        process, this checkout's code first on the path (a copy of the tree measures
        itself, not the editable install)."""
        environment = {k: v for k, v in os.environ.items() if not k.startswith("SHEPHERD_")}
        environment.update(SHEPHERD_BMDB_URL=self.url, PYTHONPATH=ROOT)
        shepherd = os.path.join(os.path.dirname(sys.executable), "shepherd")
        subprocess.run([shepherd, "machines"], env=environment, check=True,
                       capture_output=True, timeout=600)

    def floor(self) -> None:
        """What any Python CLI on this BMDB pays, side by side with ``cli``: a new
        process that imports SQLAlchemy, connects with psycopg2 and reads 500 rows."""
        script = ("import sys, sqlalchemy as sa\n"
                  "with sa.create_engine(sys.argv[1]).connect() as c:\n"
                  "    c.execute(sa.text('SELECT machine_id FROM provided LIMIT 500')).all()\n")
        subprocess.run([sys.executable, "-c", script, self.url], check=True,
                       capture_output=True, timeout=600)


def _cancel(claimed: list[bmdb.Work]) -> None:
    """Release what a path claimed, so the next run sees the same fleet."""
    for work in claimed:
        work.cancel("bench: released")


def public_bytes(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw,
                                         serialization.PublicFormat.Raw)


def signed_heartbeat(key: Ed25519PrivateKey, nonce: str, machine: uuid.UUID) -> dict[str, Any]:
    """``requests.post`` arguments for one v2 heartbeat of ``machine``, stamped now."""
    stamp = f"{time.time():.6f}"
    body = json.dumps({"machine_id": str(machine)}).encode()
    signature = key.sign(signing_payload(machine, public_bytes(key), nonce, "POST",
                                         HEARTBEAT_PATH, stamp, body))
    return {"data": body, "headers": {
        HEADER_MACHINE: str(machine), HEADER_TIMESTAMP: stamp,
        HEADER_SIGNATURE: base64.b64encode(signature).decode(),
        "Content-Type": "application/json"}}


# -- the updater, in a process of its own -------------------------------------------------------


def updater_child(url: str, size: int, runs: int, budget: float
                  ) -> tuple[list[float], float, float]:
    """(ms per run, peak memory growth in MB, ms to make the listing) of ``update``
    against a matching listing.

    Runs in a fresh (spawned) process: the growth of its peak resident set is the
    updater's, not what the parent or earlier sizes left behind. The listing is made
    before the clock and the memory mark, as a provider that has it in hand: making a
    million ``ProviderMachine`` objects is the provider's cost (seconds of Python),
    which no updater can save; what it costs is reported beside the figure.
    """
    started = time.perf_counter()
    listing = list(Listing(size))
    made = (time.perf_counter() - started) * 1000
    db = bmdb.connect(url)
    # A long lease: the slow baseline (16 s of Python at 1M) starved a 5 s one of its
    # keep-alive on a loaded 2-core machine, and this measures time, not leases.
    with db.start_session("bench-updater", interval=60) as session:
        provider = BenchProvider(listing)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

        def step() -> None:
            result = updater.update(session, provider)
            if result.updated or result.missing or result.unchanged != size:
                raise RuntimeError(f"the listing does not match the fleet: {result}")

        timing = measure(step, runs, budget)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    db.close()
    return timing.runs, grown / 1024, made


def time_updater(url: str, size: int, runs: int, budget: float, notes: list[str]) -> Timing:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        times, mb, made = pool.apply(updater_child, (url, size, runs, budget))
    notes.append(f"the updater's listing of {label(size)} took {made:,.0f} ms to make "
                 "(before the clock: the provider's share)")
    return Timing(times, mb)


# -- a run ---------------------------------------------------------------------------------------


@dataclass
class Results:
    """Per column (a fleet size, or the size with more history), per path, a ``Timing``."""

    columns: list[str] = field(default_factory=list)
    timings: dict[str, dict[str, Timing]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, column: str, key: str, timing: Timing) -> None:
        if column not in self.columns:
            self.columns.append(column)
        self.timings.setdefault(key, {})[column] = timing


def label(count: int) -> str:
    for unit, name in ((1_000_000, "M"), (1_000, "k")):
        if count >= unit and count % unit == 0:
            return f"{count // unit}{name}"
    return str(count)


def run_paths(bench: Bench, column: str, results: Results, args: argparse.Namespace,
              size: int, with_updater: bool = True) -> None:
    steps = bench.steps()
    for path in PATHS:
        if path.key not in args.paths or (path.key == "updater" and not with_updater):
            continue
        try:
            timing = (time_updater(bench.url, size, args.runs, args.budget, results.notes)
                      if path.key == "updater" else
                      measure(steps[path.key], args.runs, args.budget))
        except Exception as error:  # one broken path must not lose the others' figures
            timing = Timing([], error=f"{type(error).__name__}: {error}")
            results.notes.append(f"{path.key} at {column} failed: {timing.error}")
        results.add(column, path.key, timing)
        log(f"  {column:>18} {path.key:<10} {timing.median:>10.1f} ms"
            + (f"  +{timing.mb:.0f} MB" if timing.mb is not None else "")
            + (f"  {timing.error}" if timing.error else ""))


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def bench_on(url: str, shape: Shape) -> Iterator[Bench]:
    """A callback server (its own BMDB handle, its guard checking its own /healthz) and
    a session for the claiming paths, for the length of the run."""
    port = free_port()
    limits = GuardLimits(healthz_url=f"http://127.0.0.1:{port}/healthz")
    db, server_db = bmdb.connect(url), bmdb.connect(url)
    try:
        settings = Settings(bmdb_url=url, serve_listen=f"127.0.0.1:{port}", metrics_cache=0.0)
        options = dataclasses.replace(ServeOptions.from_settings(settings), guard=limits)
        with start_server(Runtime(settings, COMPONENT, db=server_db), options,
                          operator_api) as server, \
                db.start_session("bench") as session:
            token, _ = tokens.create(session, "bench", Role.VIEWER, None, "bench")
            yield Bench(url, db, server, session, limits, shape, token=token)
    finally:
        db.close()
        server_db.close()


def run(url: str, args: argparse.Namespace) -> Results:
    shape, results, built = Shape.for_fleet(args.sizes[0]), Results(), 0
    engine = sa.create_engine(url)
    with bench_on(url, shape) as bench:
        for size in args.sizes:
            started = time.perf_counter()
            with indexes_rebuilt(engine, "history"):
                grow_fleet(engine, built, size, shape, args.chunk)
            if built == 0:
                set_probe_key(engine, shape.probe, public_bytes(bench.key), bench.nonce)
            built = size
            vacuum(engine)
            log(f"fleet of {label(size)} built in {time.perf_counter() - started:.0f} s")
            run_paths(bench, label(size), results, args, size)
        if args.history_rows:
            extra_history(engine, bench, built, results, args)
    engine.dispose()
    return results


def extra_history(engine: sa.Engine, bench: Bench, size: int, results: Results,
                  args: argparse.Namespace) -> None:
    per_machine = max(0, round(args.history_rows / size) - len(BASE_HISTORY))
    started = time.perf_counter()
    with indexes_rebuilt(engine, "history"):
        grow_history(engine, size, per_machine, args.chunk)
    vacuum(engine)
    column = f"{label(size)} + {label(args.history_rows)} history"
    log(f"history grown to ~{label(args.history_rows)} rows in "
        f"{time.perf_counter() - started:.0f} s")
    run_paths(bench, column, results, args, size, with_updater=False)


# -- the report ----------------------------------------------------------------------------------


def cell(timing: Timing | None, runs: int) -> str:
    if timing is None:
        return "-"
    if timing.error is not None:
        return "failed"
    value = timing.median
    text = f"{value:.1f}" if value < 10 else f"{value:,.0f}"
    if timing.mb is not None:
        text += f" (+{timing.mb:,.0f} MB)"
    return text + ("†" if len(timing.runs) < runs else "")


def misses(path: Path, by_column: dict[str, Timing], first: str, last: str,
           large: bool) -> list[str]:
    """The issue's aims ``path`` misses, judged between columns ``first`` and ``last``."""
    low, high = by_column.get(first), by_column.get(last)
    if low is None or high is None:
        return []
    if low.error or high.error:
        return [f"failed at {first if low.error else last}"]
    found = []
    growth = high.median / low.median
    # The updater compares every machine: it cannot be flat, its aims are absolute.
    if growth > (HTTP_GROWTH if path.http else GROWTH) and path.key != "updater":
        found.append(f"grows {growth:.2f}x")
    if large and (path.http or path.key == "guard") and high.median > 50:
        found.append(f"{high.median:,.0f} ms > 50 ms")
    if path.key == "cli" and first == label(ISSUE_SIZES[0]) and low.median > 300:
        found.append(f"{low.median:,.0f} ms > 300 ms at {first}")
    if large and path.key == "updater":
        if high.median > 2000:
            found.append(f"{high.median / 1000:.1f} s > 2 s")
        if high.mb is not None and high.mb > 100:
            found.append(f"+{high.mb:,.0f} MB > 100 MB")
    return found


def report(results: Results, sizes: list[int], runs: int) -> str:
    first, last = label(sizes[0]), label(sizes[-1])
    large = sizes[-1] >= LARGE
    lines = [f"| path | {' | '.join(results.columns)} | {last}/{first} | aims |",
             "|---" * (len(results.columns) + 3) + "|"]
    for path in PATHS:
        by_column = results.timings.get(path.key, {})
        if not by_column:
            continue
        cells = [cell(by_column.get(column), runs) for column in results.columns]
        low, high = by_column.get(first), by_column.get(last)
        growth = (f"{high.median / low.median:.2f}x" if low and high and low.runs
                  and high.runs else "-")
        missed = misses(path, by_column, first, last, large)
        aims = ("MISSED: " + "; ".join(missed)) if missed else "ok"
        lines.append(f"| {path.label} | {' | '.join(cells)} | {growth} | {aims} |")
    lines.append("")
    lines.append(f"Medians of {runs} runs after a warm-up, in ms; † fewer runs (the path "
                 f"exceeded its time budget). Aims: growth {first} -> {last} <= "
                 f"{HTTP_GROWTH}x for HTTP paths, <= {GROWTH}x for the others (not "
                 "the updater's: it compares every machine)"
                 + ("; HTTP paths and the guard <= 50 ms, the updater <= 2 s and <= 100 MB "
                    f"at {last}." if large else f"; the absolute aims apply at {label(LARGE)}."))
    lines += [f"- {note}" for note in results.notes]
    return "\n".join(lines)


def as_json(results: Results) -> dict[str, Any]:
    return {key: {column: {"median_ms": t.median, "runs_ms": t.runs, "mb": t.mb}
                  for column, t in by_column.items()}
            for key, by_column in results.timings.items()}


def parse_args() -> argparse.Namespace:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(map(str, ISSUE_SIZES)),
                        help="fleet sizes, comma-separated (grown in ascending order)")
    parser.add_argument("--history-rows", type=int, default=10_000_000,
                        help="history rows for one more run at the largest size (0: skip)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--budget", type=float, default=30.0,
                        help="seconds per path and size after which 3 runs are enough")
    parser.add_argument("--chunk", type=int, default=100_000,
                        help="machines per fleet-building transaction")
    parser.add_argument("--quick", action="store_true",
                        help="10k and 100k only, no extra history (a smoke run)")
    parser.add_argument("--paths", default=",".join(p.key for p in PATHS),
                        help="which paths to time, comma-separated (default: all)")
    args = parser.parse_args()
    args.sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    args.paths = {p.strip() for p in args.paths.split(",") if p.strip()}
    if args.paths - {p.key for p in PATHS}:
        parser.error(f"unknown paths: {sorted(args.paths - {p.key for p in PATHS})}")
    if args.quick:
        args.sizes, args.history_rows = [10_000, 100_000], 0
    if not args.sizes or args.sizes[-1] >= 1 << 24 or args.runs < 1:
        parser.error("sizes between 1 and 16M, and at least one run")
    return args


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    with postgres(args.pg_url) as url:
        results = run(url, args)
    print(report(results, args.sizes, args.runs))
    log(f"total {math.ceil(time.perf_counter() - started)} s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(as_json(results), handle, indent=1)


if __name__ == "__main__":
    main()
