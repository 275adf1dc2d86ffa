"""Signed heartbeats/s into PostgreSQL: ``shepherd serve`` against a bare psycopg2 loop.

Four figures from one run, on one PostgreSQL (fsync on) with ``--machines`` agents:

(a) one ``shepherd serve`` process (its defaults: group commit, 2 batches at
    once), loaded by ``--clients`` concurrent clients, each heartbeat on a new
    connection as an agent sends it every minute; then the same clients paced at 80 %
    of the rate it sustained (``PACED``), for the latency of a busy server that
    keeps up. Each run also counts PostgreSQL's commits per accepted heartbeat (the
    batches: ``shepherd.server.group_commit``; the bare loop commits each one);
(b) the bare loop: the same checks and writes with nothing around them, in one
    process with ``--threads`` threads (16: at fewer it does less), each on its own
    psycopg2 connection: the session check, the credentials' row lock and read (which
    brings the pending installation and the heartbeat_seen marker), the ed25519
    verification of the same pre-signed heartbeats (the server's own check,
    ``shepherd.ed25519``), the upsert, the marker's update
    when it was not set yet, the commit;
(c) two ``shepherd serve`` processes on the same PostgreSQL, the clients split between
    them (as behind a load balancer);
(d) (c) against (a) again, with every server process capped at ``--capped``
    cores (a cgroup CPU quota): on a 2-core machine an uncapped server, PostgreSQL
    and the load generator fill both cores, so (c) shows the machine's limit; capped,
    the ratio shows what a second process adds when it has a core share of its own.

(a) flat out and (b) run interleaved, in ``--rounds`` slices each (the server idle
while the loop runs), so that a change of the machine's speed during the run (a shared
machine's neighbours) weighs on both sides of their ratio alike.

The load generator (``load``) is cheap so that it is not what is measured: requests
are signed before the clock starts, and sent as raw bytes from asyncio on uvloop in a
process of its own.

    .venv/bin/python -m bench.heartbeat_ingest [--pg-url URL] [--requests 6000] [--json FILE]
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import json
import multiprocessing
import os
import random
import re
import shlex
import ssl
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg2
import sqlalchemy as sa
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import bmdb
from bench.common import arguments, commits, fetch_one, postgres, psycopg2_dsn
from shepherd import ed25519
from shepherd.agent.protocol import (
    HEADER_MACHINE,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    HEARTBEAT_PATH,
    signing_payload,
)
from shepherd.server.asgi_server import new_event_loop
from tests.support.servers import free_port, wait_for_port

REPO = Path(__file__).resolve().parent.parent


# -- the fleet and its pre-signed heartbeats ------------------------------------------------


@dataclass(frozen=True)
class Agent:
    machine: uuid.UUID
    key: Ed25519PrivateKey
    public: bytes
    nonce: str


@dataclass(frozen=True)
class Heartbeat:
    """One signed heartbeat, ready to send (``raw``) or to check (the rest)."""

    agent: Agent
    stamp: str
    body: bytes
    signature: bytes
    raw: bytes


def seed(url: str, count: int) -> list[Agent]:
    """``count`` machines, each with a key and a takeover nonce in AgentStarted."""
    agents = []
    for _ in range(count):
        key = Ed25519PrivateKey.generate()
        public = key.public_key().public_bytes(serialization.Encoding.Raw,
                                               serialization.PublicFormat.Raw)
        agents.append(Agent(uuid.uuid4(), key, public,
                            base64.b64encode(os.urandom(32)).decode()))
    db = bmdb.connect(url)

    def body(tx: bmdb.Tx) -> None:
        for agent in agents:
            bmdb.create_machine(tx, agent.machine)
            bmdb.set_agent_started(tx, agent.machine, agent.public, agent.nonce)

    db.read(body)
    with db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM ANALYZE")
    db.close()
    return agents


def sign(agents: Sequence[Agent], total: int, clients: int) -> list[list[Heartbeat]]:
    """``total`` heartbeats, dealt to ``clients``: each machine belongs to one client,
    whose heartbeats for it carry strictly increasing timestamps (as one agent's do)."""
    base = time.time()
    per_client: list[list[Heartbeat]] = [[] for _ in range(clients)]
    for n in range(total):
        agent = agents[n % len(agents)]
        stamp = f"{base + (n // len(agents)) * 0.001:.6f}"
        body = json.dumps({"machine_id": str(agent.machine)}).encode()
        signature = agent.key.sign(signing_payload(agent.machine, agent.public, agent.nonce,
                                                   "POST", HEARTBEAT_PATH, stamp, body))
        headers = {HEADER_MACHINE: str(agent.machine), HEADER_TIMESTAMP: stamp,
                   HEADER_SIGNATURE: base64.b64encode(signature).decode(),
                   "Content-Type": "application/json", "Content-Length": str(len(body)),
                   "Host": "shepherd", "Connection": "close"}
        raw = (f"POST {HEARTBEAT_PATH} HTTP/1.1\r\n"
               + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode() + body
        client = (n % len(agents)) % clients
        per_client[client].append(Heartbeat(agent, stamp, body, signature, raw))
    return per_client


# -- the load generator -----------------------------------------------------------------------


@dataclass
class Outcome:
    """What one burst saw: per request, its latency (s) and status (0: no answer), and
    the CPU seconds each side spent meanwhile (``cpu``: servers, PostgreSQL, load)."""

    elapsed: float
    latencies: list[float]
    statuses: list[int]
    cpu: dict[str, float]
    #: PostgreSQL commits in the bench's database meanwhile (None: not measured).
    commits: int | None = None

    @property
    def ok(self) -> int:
        return self.statuses.count(200)

    @property
    def errors(self) -> int:
        return len(self.statuses) - self.ok

    @property
    def rate(self) -> float:
        return self.ok / self.elapsed

    def percentile(self, share: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(share * len(ordered)))] * 1000

    @property
    def commits_per_heartbeat(self) -> float:
        return float("nan") if self.commits is None else self.commits / max(self.ok, 1)

    def line(self, name: str) -> str:
        per = {k: v / max(self.ok, 1) * 1000 for k, v in self.cpu.items()}
        cpu = "  ".join(f"{per.get(k, float('nan')):>5.2f}" for k in CPU_COLUMNS)
        return (f"{name:<34} {len(self.statuses):>6} {self.errors:>6} {self.rate:>8.0f} "
                f"{statistics.median(self.latencies) * 1000:>8.1f} "
                f"{self.percentile(0.99):>8.1f} {self.commits_per_heartbeat:>7.3f}  {cpu}")


CPU_COLUMNS = ("server", "postgres", "load")
HEADER = (f"{'':<34} {'sent':>6} {'errors':>6} {'hb/s':>8} {'p50 ms':>8} {'p99 ms':>8}"
          f" {'commits':>7}  CPU ms per heartbeat: server, PostgreSQL, load generator")


# -- CPU accounting (Linux /proc) ----------------------------------------------------------


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int, children: bool = False) -> float:
    """CPU seconds of ``pid`` (with its reaped children's), plus with ``children`` its
    live children's: a PostgreSQL postmaster and its backends."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        fields = _stat(pid)
    except OSError:
        return 0.0
    total = sum(int(fields[i]) for i in (11, 12, 13, 14)) / tick
    if children:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError, IndexError):
                    child = _stat(int(entry))
                    if int(child[1]) == pid:
                        total += (int(child[11]) + int(child[12])) / tick
    return total


def listener_pid(port: int) -> int | None:
    """The process listening on ``port`` here (PostgreSQL's postmaster), if visible."""
    found = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True,
                           text=True, check=False).stdout
    match = re.search(r"pid=(\d+)", found)
    return int(match.group(1)) if match else None


async def _send(addresses: Sequence[tuple[str, int]], raw: bytes, tls: ssl.SSLContext | None,
                timeout: float) -> int:
    host, port = addresses[0]
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(host, port, ssl=tls, server_hostname=host if tls else None),
        timeout)
    try:
        writer.write(raw)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        status = int(head.split(b" ", 2)[1])
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await asyncio.wait_for(reader.readexactly(length), timeout)
        return status
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def _client(addresses: Sequence[tuple[str, int]], heartbeats: Sequence[bytes],
                  tls: ssl.SSLContext | None, timeout: float,
                  latencies: list[float], statuses: list[int],
                  every: float | None = None) -> None:
    """Send one heartbeat after the other; with ``every``, one each ``every`` seconds
    from a random phase (an open schedule: a late answer does not delay the next
    send's slot, it only makes the send itself late)."""
    slot = time.perf_counter() + (random.uniform(0, every) if every else 0.0)
    for raw in heartbeats:
        if every:
            await asyncio.sleep(max(0.0, slot - time.perf_counter()))
            slot += every
        started = time.perf_counter()
        try:
            status = await _send(addresses, raw, tls, timeout)
        except Exception:
            status = 0
        latencies.append(time.perf_counter() - started)
        statuses.append(status)


def _burst(addresses: list[tuple[str, int]], per_client: list[list[bytes]],
           ca_file: str | None, timeout: float, rate: float | None = None
           ) -> tuple[float, list[float], list[int], float]:
    tls = ssl.create_default_context(cafile=ca_file) if ca_file else None
    latencies: list[float] = []
    statuses: list[int] = []

    every = len(per_client) / rate if rate else None

    async def run() -> float:
        started = time.perf_counter()
        await asyncio.gather(*(
            _client([addresses[i % len(addresses)]], heartbeats, tls, timeout, latencies,
                    statuses, every)
            for i, heartbeats in enumerate(per_client)))
        return time.perf_counter() - started

    cpu = time.process_time()
    # The server's own event loop (uvloop): on two cores, every millisecond the load
    # generator spends is one the server under test does not get.
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        elapsed = runner.run(run())
    return elapsed, latencies, statuses, time.process_time() - cpu


def load(servers: Sequence[Server], per_client: list[list[Heartbeat]],
         ca_file: str | None = None, timeout: float = 30.0,
         rate: float | None = None) -> Outcome:
    """Send every client's heartbeats (client i to ``servers[i % n]``), from a process
    of its own; each heartbeat on a new connection. ``rate``: heartbeats per second
    in all, paced (``_client``); else each client sends as soon as it is answered."""
    raw = [[h.raw for h in heartbeats] for heartbeats in per_client]
    addresses = [(server.host, server.port) for server in servers]
    postgres_pid = servers[0].postgres if servers else None
    database = servers[0].database if servers else None
    before = (sum(cpu_seconds(server.pid) for server in servers),
              cpu_seconds(postgres_pid, children=True) if postgres_pid else 0.0,
              commits(database) if database else 0)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        elapsed, latencies, statuses, load_cpu = pool.apply(
            _burst, (addresses, raw, ca_file, timeout, rate))
    cpu = {"server": sum(cpu_seconds(server.pid) for server in servers) - before[0],
           "load": load_cpu}
    if postgres_pid:
        cpu["postgres"] = cpu_seconds(postgres_pid, children=True) - before[1]
    committed = commits(database) - before[2] if database else None
    return Outcome(elapsed, latencies, statuses, cpu, committed)


# -- the server ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Server:
    """A server process under load, and the PostgreSQL it writes to (its postmaster's
    pid, when it runs here)."""

    host: str
    port: int
    pid: int
    postgres: int | None
    #: The BMDB's URL (its commits are counted: ``commits``).
    database: str | None = None


CGROUP_V1 = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")


@contextlib.contextmanager
def cpu_capped(pid: int, name: str, cores: float | None) -> Iterator[None]:
    """Run process ``pid`` (all its threads) under a CPU quota of ``cores`` (None: none).

    Why: on a 2-core machine one uncapped server, PostgreSQL and the load generator
    already use every core, so a second server process has nothing to run on and
    "2 processes vs 1" would measure the machine, not the server. Capped, each
    process has the same share of a core in both runs, and the ratio shows whether
    a second process adds its share (nothing shared but the BMDB) or not.
    """
    if not cores:
        yield
        return
    period = 100_000
    root = CGROUP_V1 if (CGROUP_V1 / "cgroup.procs").exists() else CGROUP_V2
    group = root / f"shepherd-bench-{name}-{pid}"
    group.mkdir()
    try:
        if root is CGROUP_V1:
            (group / "cpu.cfs_period_us").write_text(str(period))
            (group / "cpu.cfs_quota_us").write_text(str(int(cores * period)))
        else:
            (group / "cpu.max").write_text(f"{int(cores * period)} {period}")
        (group / "cgroup.procs").write_text(str(pid))
        yield
    finally:
        with contextlib.suppress(OSError):
            (root / "cgroup.procs").write_text(str(pid))  # back out, if still alive
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


@contextlib.contextmanager
def serve(url: str, workdir: Path, name: str, env: dict[str, str] | None = None,
          argv: Sequence[str] = (), cores: float | None = None) -> Iterator[Server]:
    """A ``shepherd serve`` process on a free loopback port (``argv``: another command),
    capped at ``cores`` of CPU when given (``cpu_capped``)."""
    port = free_port()
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SHEPHERD_")}
    environment.update(SHEPHERD_BMDB_URL=url, SHEPHERD_SERVE_LISTEN=f"127.0.0.1:{port}",
                       PYTHONUNBUFFERED="1", **(env or {}))
    command = list(argv) or [sys.executable, "-m", "shepherd.cli", "serve"]
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / f"{name}.log", "wb") as log:
        process = subprocess.Popen(command, cwd=REPO, env=environment, stdout=log,
                                   stderr=subprocess.STDOUT)
    try:
        with cpu_capped(process.pid, name, cores):
            wait_for_port("127.0.0.1", port, timeout=60)
            database = sa.make_url(url)
            postgres_pid = listener_pid(database.port or 5432) if database.host in (
                "127.0.0.1", "localhost") else None
            yield Server("127.0.0.1", port, process.pid, postgres_pid, url)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# -- the bare loop ------------------------------------------------------------------------------

SESSION_CHECK = "SELECT deadline, now() FROM sessions WHERE id = %s FOR KEY SHARE"
LOCK = "SELECT machine_id FROM agent_started WHERE machine_id = %s FOR NO KEY UPDATE"
CREDENTIALS = """SELECT agent_started.public_key, agent_started.nonce,
    agent_started.heartbeat_seen, agent_heartbeat.last_signed_at,
    os_installation_request.generation, os_installation_request.request,
    os_installation_report.generation
    FROM agent_started LEFT OUTER JOIN agent_heartbeat
    ON agent_heartbeat.machine_id = agent_started.machine_id
    LEFT OUTER JOIN os_installation_request
    ON os_installation_request.machine_id = agent_started.machine_id
    LEFT OUTER JOIN os_installation_report
    ON os_installation_report.machine_id = agent_started.machine_id
    WHERE agent_started.machine_id = %s"""
UPSERT = """INSERT INTO agent_heartbeat (machine_id, last_heartbeat_at, last_signed_at)
    VALUES (%s, %s, %s) ON CONFLICT (machine_id) DO UPDATE
    SET last_heartbeat_at = excluded.last_heartbeat_at,
        last_signed_at = excluded.last_signed_at"""
MARK = ("UPDATE agent_started SET heartbeat_seen = true WHERE machine_id = %s "
        "AND heartbeat_seen != true")


def bare(url: str, per_client: list[list[Heartbeat]], threads: int
         ) -> tuple[float, int, dict[str, float]]:
    """The heartbeats' checks and writes with nothing around them: (seconds, accepted,
    CPU seconds of this loop and of PostgreSQL)."""
    db = bmdb.connect(url)
    session = db.start_session("bench-bare", interval=5)
    queues = [[h for i, hs in enumerate(per_client) if i % threads == t for h in hs]
              for t in range(threads)]
    accepted: list[int] = []
    connections = [psycopg2.connect(psycopg2_dsn(url)) for _ in range(threads)]

    def run(conn: psycopg2.extensions.connection, heartbeats: list[Heartbeat]) -> None:
        done = 0
        cur = conn.cursor()
        for h in heartbeats:
            machine = str(h.agent.machine)
            cur.execute(SESSION_CHECK, (str(session.id),))
            _, now = fetch_one(cur)
            cur.execute(LOCK, (machine,))
            cur.execute(CREDENTIALS, (machine,))
            public, nonce, seen, last, _, _, _ = fetch_one(cur)
            signed_at = dt.datetime.fromtimestamp(float(h.stamp), dt.UTC)
            if not ed25519.verifies(bytes(public), h.signature, signing_payload(
                    machine, bytes(public), nonce, "POST", HEARTBEAT_PATH, h.stamp, h.body)):
                conn.rollback()
                continue
            if last is not None and signed_at <= last:
                conn.rollback()
                continue
            cur.execute(UPSERT, (machine, now, signed_at))
            if not seen:
                cur.execute(MARK, (machine,))
            conn.commit()
            done += 1
        accepted.append(done)

    workers = [threading.Thread(target=run, args=(conn, queue))
               for conn, queue in zip(connections, queues, strict=True)]
    postgres_pid = listener_pid(sa.make_url(url).port or 5432)
    before = (time.process_time(),
              cpu_seconds(postgres_pid, children=True) if postgres_pid else 0.0)
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - started
    cpu = {"server": time.process_time() - before[0]}
    if postgres_pid:
        cpu["postgres"] = cpu_seconds(postgres_pid, children=True) - before[1]
    for conn in connections:
        conn.close()
    session.close()
    db.close()
    return elapsed, sum(accepted), cpu


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--machines", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=6000, help="per measurement")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--threads", type=int, default=16,
                        help="the bare loop's threads (the server runs on its defaults, "
                             "but for --server-env)")
    parser.add_argument("--server-env", nargs="*", default=[], metavar="NAME=VALUE",
                        help="more settings for the servers (SHEPHERD_...)")
    parser.add_argument("--server-argv", type=shlex.split, default=[],
                        help="a command to run instead of `shepherd serve` (one string)")
    parser.add_argument("--capped", type=float, default=0.35, metavar="CORES",
                        help="also run 1 and 2 server processes each capped at CORES of "
                             "CPU (cgroup quota; 0: skip)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="slices the server's and the bare loop's measurements are "
                             "interleaved in")
    parser.add_argument("--warmup", type=int, default=None,
                        help="heartbeats sent to each set of servers before measuring "
                             "(default: one per machine, so that each measured heartbeat, "
                             "the bare loop's included, is the next of a machine heard "
                             "from before, as in a running fleet)")
    args = parser.parse_args()
    if args.warmup is None:
        args.warmup = args.machines
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"shepherd-bench-{uuid.uuid4().hex[:8]}"
    env = dict(item.split("=", 1) for item in args.server_env)
    with postgres(args.pg_url) as url:
        agents = seed(url, args.machines)
        load([], [])  # start the spawn machinery once, outside the clock
        print(HEADER)
        with serve(url, workdir, "one", env, args.server_argv) as server:
            load([server], sign(agents, args.warmup, args.clients))  # warm up
            one, (elapsed, accepted, cpu) = interleaved(url, server, agents, args)
            print(one.line("1 server process"))
            paced = load([server], sign(agents, args.requests, args.clients),
                         rate=PACED * one.rate)
        print(paced.line(f"1 server process, paced at {PACED:.0%}"))
        per = {k: v / max(accepted, 1) * 1000 for k, v in cpu.items()}
        print(f"{'bare psycopg2 loop, ' + str(args.threads) + ' threads':<34} "
              f"{args.requests:>6} {args.requests - accepted:>6} {accepted / elapsed:>8.0f} "
              f"{'':>8} {'':>8}  {per['server']:>5.2f}  {per.get('postgres', float('nan')):>5.2f}")
        with serve(url, workdir, "first", env, args.server_argv) as first, \
                serve(url, workdir, "second", env, args.server_argv) as second:
            load([first, second], sign(agents, args.warmup, args.clients))
            two = load([first, second], sign(agents, args.requests, args.clients))
        print(two.line("2 server processes"))
        capped = scaling_capped(url, workdir, env, args, agents) if args.capped else None
    print(f"1 server process vs the bare loop: {one.rate / (accepted / elapsed):.2f}x "
          f"(aim >= 1.0x), {one.commits_per_heartbeat:.3f} commits per heartbeat (aim <= "
          f"0.2); paced at {PACED:.0%} of its rate, p99 {paced.percentile(0.99):.0f} ms "
          f"(aim < 100 ms); 2 processes vs 1: {two.rate / one.rate:.2f}x")
    if capped:
        print(f"capped at {args.capped:g} core each, 2 processes vs 1: {capped:.2f}x "
              f"(aim >= 1.6x)")
    if args.json:
        bare_figures = {"sent": args.requests, "errors": args.requests - accepted,
                        "heartbeats_per_s": accepted / elapsed,
                        **{f"{k}_cpu_ms_per_heartbeat": v for k, v in per.items()}}
        args.json.write_text(json.dumps({
            "one_process": summary(one), "one_process_paced": summary(paced),
            "bare_loop": bare_figures,
            "two_processes": summary(two),
            "one_process_to_bare": one.rate / (accepted / elapsed),
            "two_processes_to_one": two.rate / one.rate, "capped_two_to_one": capped},
            indent=1))


def interleaved(url: str, server: Server, agents: list[Agent], args: Any
                ) -> tuple[Outcome, tuple[float, int, dict[str, float]]]:
    """``args.requests`` heartbeats to ``server`` flat out, and as many through the bare
    loop, in ``args.rounds`` alternating slices: the server's outcome, and the loop's
    (seconds, accepted, CPU seconds), each summed over its slices."""
    rounds = max(1, min(args.rounds, args.requests))
    served: list[Outcome] = []
    looped: list[tuple[float, int, dict[str, float]]] = []
    for n in range(rounds):
        size = args.requests // rounds + (n < args.requests % rounds)
        served.append(load([server], sign(agents, size, args.clients)))
        looped.append(bare(url, sign(agents, size, args.clients), args.threads))
    return combined(served), (sum(e for e, _, _ in looped), sum(a for _, a, _ in looped),
                              summed(spent for _, _, spent in looped))


def combined(outcomes: Sequence[Outcome]) -> Outcome:
    """Several bursts as one: times, latencies, statuses, CPU and commits summed."""
    counted = [o.commits for o in outcomes]
    return Outcome(sum(o.elapsed for o in outcomes),
                   [latency for o in outcomes for latency in o.latencies],
                   [status for o in outcomes for status in o.statuses],
                   summed(o.cpu for o in outcomes),
                   None if None in counted else sum(c for c in counted if c is not None))


def summed(parts: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """CPU seconds by side (server, PostgreSQL, load), summed over several bursts."""
    total: dict[str, float] = {}
    for part in parts:
        for side, seconds in part.items():
            total[side] = total.get(side, 0.0) + seconds
    return total


#: The paced run's rate, as a share of the rate the server sustained unpaced: the
#: latency an operator sees when the server is busy but keeping up.
PACED = 0.8


def summary(outcome: Outcome) -> dict[str, float]:
    """A burst's line of the table, for ``--json`` (CPU: ms per accepted heartbeat)."""
    return {"sent": len(outcome.statuses), "errors": outcome.errors,
            "heartbeats_per_s": outcome.rate,
            "p50_ms": statistics.median(outcome.latencies) * 1000,
            "p99_ms": outcome.percentile(0.99),
            "commits_per_heartbeat": outcome.commits_per_heartbeat,
            **{f"{k}_cpu_ms_per_heartbeat": v / max(outcome.ok, 1) * 1000
               for k, v in outcome.cpu.items()}}


def scaling_capped(url: str, workdir: Path, env: dict[str, str], args: Any,
                   agents: list[Agent]) -> float | None:
    """1 and 2 server processes, each capped at ``args.capped`` cores (``cpu_capped``):
    the second one's ratio, or None where this machine cannot cap (not root, no cgroup)."""
    try:
        with serve(url, workdir, "capped-one", env, args.server_argv, args.capped) as server:
            load([server], sign(agents, 300, args.clients))
            one = load([server], sign(agents, args.requests // 2, args.clients))
        with serve(url, workdir, "capped-first", env, args.server_argv, args.capped) as first, \
                serve(url, workdir, "capped-second", env, args.server_argv,
                      args.capped) as second:
            load([first, second], sign(agents, 300, args.clients))
            two = load([first, second], sign(agents, args.requests // 2, args.clients))
    except OSError as error:
        print(f"capped runs skipped: cannot cap CPU here ({error})")
        return None
    print(one.line(f"1 process, capped {args.capped:g} core"))
    print(two.line(f"2 processes, capped {args.capped:g} core each"))
    return two.rate / one.rate


if __name__ == "__main__":
    main()
