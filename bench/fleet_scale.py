"""A fleet at scale: N simulated agents heartbeating against K ``shepherd serve`` processes.

A fleet of ``--machines`` in the issue's shape (``bench.scale``'s: 3 % silent, some
awaiting a takeover, some held); each of its ordinary machines' agents sends a real v2
heartbeat (``shepherd.agent.protocol``'s body, headers and signature, with a key of
its own, over a new connection, as an agent does) every ``--interval`` seconds for
``--duration`` seconds, to ``--servers`` server processes on one PostgreSQL (agent i to
server i mod K, as behind a load balancer). No SSH, no agent processes: a load
generator stands in for the agents. The same load runs ``--warmup`` seconds first,
not measured.

The arrivals are open-loop, as a fleet's are: agent i's heartbeats leave at
``start + k * interval + phase[i]`` whatever the servers answer, the phases spread
evenly over the interval with jitter (each agent at a random point of its own slot).
A closed loop (send, wait, send) would slow down with the server and hide its limit.
Each heartbeat is signed for its own send time, ahead of it, by ``--signers`` worker
processes, so that signing does not hold back the sender (one asyncio process).

Reported (``--json FILE``: the same as one JSON document, written there too):
- offered rate (agents / interval), accepted heartbeats/s (the measured heartbeats
  accepted, over the time from the warm-up's end to the last answer), errors by
  status ("timeout", "connection": no answer), p50/p99 latency (from the connect to
  the end of the answer);
- whether the generator kept the offered rate: how late it sent (p99, max);
- PostgreSQL commits per accepted heartbeat: the bench database's
  ``pg_stat_database.xact_commit`` over the servers' whole lifetime (read with no
  backend left on it, so every backend's statistics are flushed): it includes the
  servers' start and their own periodic work, which a long run makes small;
- CPU ms per accepted heartbeat over the load (``/proc``, utime+stime): the server
  processes, PostgreSQL (postmaster and backends, when it runs on this host) and the
  load generator (sender and signers).

    .venv/bin/python -m bench.fleet_scale [--machines 6000] [--interval 60]
        [--duration 30] [--servers 1] [--signers 1] [--pg-url URL] [--json FILE]
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import json
import math
import multiprocessing
import os
import random
import resource
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bench.common import arguments, commits, postgres
from bench.heartbeat_ingest import Server, cpu_seconds, serve
from bench.scale import Shape, grow_fleet, machine_id, vacuum
from shepherd.agent import protocol

#: Seconds of sends one signer hands the sender at a time.
CHUNK_SECONDS = 0.25
#: Chunks a signer may be ahead of the sender (memory bound; stamps stay near their send).
AHEAD = 8
#: Seconds an agent waits for an answer (the agent's REQUEST_TIMEOUT).
REQUEST_TIMEOUT = 10.0
#: The generator processes' nice value (below the default 0: ahead of the servers).
GENERATOR_NICE = -10
#: The takeover nonce ``bench.scale`` records for every machine.
NONCE = "bench"
#: Seconds between the generator's processes being ready and the first send.
LEAD = 0.5


@dataclass(frozen=True)
class Fleet:
    """A fleet of ``size`` machines, and its simulated agents: the machine numbers (in
    ``bench.scale``'s numbering) of its ordinary, heartbeating machines, with their
    public keys (``key``)."""

    size: int
    numbers: list[int]
    publics: list[bytes]


def key(n: int) -> Ed25519PrivateKey:
    """Machine ``n``'s agent key, derived from its number: the signing processes make
    it themselves, so a million keys need not travel to them."""
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(f"fleet-{n}".encode()).digest())


def seed(url: str, machines: int, chunk: int = 50_000) -> Fleet:
    """A fleet of ``machines`` in the issue's shape (``bench.scale.grow_fleet``: 3 %
    silent, some awaiting a takeover, some held), each started machine with a key of
    its own (``key``); the agents are the machines that heartbeat."""
    shape = Shape.for_fleet(machines)
    engine = sa.create_engine(url)
    try:
        grow_fleet(engine, 0, machines, shape)
        numbers = [n for n in range(shape.silent_end + 1, machines + 1)
                   if n % shape.held_every]
        publics = [key(n).public_key().public_bytes_raw() for n in numbers]
        for lo in range(0, len(numbers), chunk):
            with engine.begin() as conn:
                conn.exec_driver_sql(
                    "UPDATE agent_started SET public_key = k.key FROM unnest(%(ids)s::uuid[], "
                    "%(keys)s::bytea[]) AS k(id, key) WHERE machine_id = k.id",
                    {"ids": [str(machine_id(n)) for n in numbers[lo:lo + chunk]],
                     "keys": publics[lo:lo + chunk]})
        vacuum(engine)
    finally:
        engine.dispose()
    return Fleet(machines, numbers, publics)


@dataclass(frozen=True)
class Schedule:
    """When each heartbeat leaves, relative to the start: heartbeat n is agent
    ``n % count``'s round ``n // count``; ``phases`` (sorted) spread the agents."""

    phases: list[float]
    interval: float
    duration: float

    @classmethod
    def spread(cls, count: int, interval: float, duration: float, seed: int = 0) -> Schedule:
        rng = random.Random(seed)
        return cls([(i + rng.random()) * interval / count for i in range(count)],
                   interval, duration)

    @property
    def total(self) -> int:
        rounds, rest = divmod(self.duration, self.interval)
        return int(rounds) * len(self.phases) + bisect.bisect_left(self.phases, rest)

    @property
    def offered(self) -> float:
        return len(self.phases) / self.interval

    def at(self, n: int) -> float:
        rounds, agent = divmod(n, len(self.phases))
        return rounds * self.interval + self.phases[agent]

    def chunks(self) -> list[range]:
        """The heartbeats in slices of about ``CHUNK_SECONDS`` of sends each."""
        size = max(1, math.ceil(self.offered * CHUNK_SECONDS))
        return [range(a, min(a + size, self.total)) for a in range(0, self.total, size)]


def heartbeat(n: int, public: bytes, signer: Ed25519PrivateKey, stamp: str) -> bytes:
    """The bytes of machine ``n``'s heartbeat signed for ``stamp``, as an agent sends it
    (``protocol.Heartbeat`` body, ``protocol.heartbeat_headers``; urllib's framing)."""
    machine = machine_id(n)
    body = protocol.Heartbeat(machine).encode()
    payload = protocol.signing_payload(machine, public, NONCE, "POST", protocol.HEARTBEAT_PATH,
                                       stamp, body)
    headers = protocol.heartbeat_headers(machine, stamp, signer.sign(payload))
    headers.update({"Content-Length": str(len(body)), "Host": "shepherd",
                    "Connection": "close"})
    return (f"POST {protocol.HEARTBEAT_PATH} HTTP/1.1\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode() + body


# -- the load generator's processes ------------------------------------------------------


@dataclass(frozen=True)
class Start:
    """How the generator's processes agree on the first send: each says it is ready
    (imports done), then waits for ``go``; ``at`` is the start's wall-clock time."""

    ready: Queue[Any]
    go: Any  # multiprocessing.Event
    at: Any  # multiprocessing.Value("d")

    def wait(self) -> tuple[float, float]:
        """The start's time, and this process's CPU seconds until then (imports).

        The generator's processes run at a higher priority than the servers (where
        allowed: root): they stand for machines elsewhere, so a busy machine should
        slow the servers under test, not the schedule of arrivals."""
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, GENERATOR_NICE)
        self.ready.put(os.getpid())
        self.go.wait()
        return float(self.at.value), time.process_time()


def _signer(fleet: Fleet, schedule: Schedule, servers: int, mine: list[range],
            out: Queue[Any], start: Start, results: Queue[Any]) -> None:
    """Sign the chunks ``mine`` in order, each heartbeat for its send time, and queue
    them (send time, server, request) for the sender."""
    keys: dict[int, Ed25519PrivateKey] = {}
    at, cpu = start.wait()
    for chunk in mine:
        items = []
        for h in chunk:
            agent = h % len(fleet.numbers)
            n = fleet.numbers[agent]
            if agent not in keys:
                keys[agent] = key(n)
            due = at + schedule.at(h)
            items.append((due, agent % servers, heartbeat(
                n, fleet.publics[agent], keys[agent], protocol.heartbeat_timestamp(due))))
        out.put(items)
    results.put(("signer", time.process_time() - cpu))


@dataclass
class Sent:
    """What the sender saw: per heartbeat (due: its send time, s after the start; late:
    how much later it left, s; its latency, s; its outcome: the HTTP status, or
    "timeout"/"connection" for no answer), and when the last answer came (wall clock)."""

    heartbeats: list[tuple[float, float, float, str]]
    last_answer: float = 0.0
    cpu: float = 0.0


class _Exchange(asyncio.Protocol):
    """One heartbeat on a connection of its own: write the request, read the answer
    until the server closes (``Connection: close``), keep its status line.

    Why not ``heartbeat_ingest``'s streams (``_send``): a protocol costs the sender
    15-40% less CPU per request (0.22-0.27 ms against 0.31-0.36 ms, measured), and on a
    small machine the sender competes for the cores with what it measures."""

    def __init__(self, raw: bytes, answered: asyncio.Future[str]) -> None:
        self.raw = raw
        self.answered = answered
        self.head = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(self.raw)

    def data_received(self, data: bytes) -> None:
        if len(self.head) < 16:
            self.head += data[:16]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.answered.done():
            status = self.head.split(b" ", 2)[1:2] if self.head.startswith(b"HTTP/") else []
            self.answered.set_result(status[0].decode() if status else "connection")


async def _exchange(address: tuple[str, int], raw: bytes) -> str:
    """The status of one heartbeat's answer ("connection": none came)."""
    loop = asyncio.get_running_loop()
    answered: asyncio.Future[str] = loop.create_future()
    transport, _ = await loop.create_connection(lambda: _Exchange(raw, answered), *address)
    try:
        return await answered
    finally:
        transport.abort()


async def _one(address: tuple[str, int], raw: bytes, due: float, start: float, sent: Sent,
               timeout: float) -> None:
    late = max(0.0, time.time() - due)
    began = time.perf_counter()
    try:
        outcome = await asyncio.wait_for(_exchange(address, raw), timeout)
    except TimeoutError:
        outcome = "timeout"
    except OSError:
        outcome = "connection"
    sent.heartbeats.append((due - start, late, time.perf_counter() - began, outcome))
    sent.last_answer = max(sent.last_answer, time.time())


async def _send_all(addresses: list[tuple[str, int]], queues: list[Queue[Any]], chunks: int,
                    start: float, timeout: float, sent: Sent) -> None:
    loop = asyncio.get_running_loop()
    pending: set[asyncio.Task[None]] = set()
    for c in range(chunks):
        items = await loop.run_in_executor(None, queues[c % len(queues)].get)
        for due, server, raw in items:
            delay = due - time.time()
            if delay > 0.001:
                await asyncio.sleep(delay)
            task = loop.create_task(_one(addresses[server], raw, due, start, sent, timeout))
            pending.add(task)
            task.add_done_callback(pending.discard)
    while pending:
        await asyncio.wait(set(pending))


def _sender(addresses: list[tuple[str, int]], queues: list[Queue[Any]], chunks: int,
            timeout: float, start: Start, results: Queue[Any]) -> None:
    """Send every signed heartbeat at its time, each on a new connection, open loop."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # one socket per request
    sent = Sent([])
    at, cpu = start.wait()
    asyncio.run(_send_all(addresses, queues, chunks, at, timeout, sent))
    sent.cpu = time.process_time() - cpu
    results.put(("sender", sent))


#: CPU seconds of the server processes and of PostgreSQL, as ``generate`` samples them.
Probe = Callable[[], tuple[float, float]]


@dataclass
class Generated:
    """The load generator's run: what it sent, from when (wall clock), its CPU seconds,
    and ``probe``'s samples when the warm-up ended and when the last answer came."""

    sent: Sent
    start: float
    cpu: float
    probed: tuple[tuple[float, float], tuple[float, float]]


def generate(servers: Sequence[Server], fleet: Fleet, schedule: Schedule,
             signers: int, warmup: float, probe: Probe,
             timeout: float = REQUEST_TIMEOUT) -> Generated:
    """Run the schedule against ``servers``, from processes of their own (spawned:
    nothing of this process's connections in them)."""
    ctx = multiprocessing.get_context("spawn")
    start = Start(ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0))
    results: Queue[Any] = ctx.Queue()
    queues: list[Queue[Any]] = [ctx.Queue(AHEAD) for _ in range(signers)]
    chunks = schedule.chunks()
    processes = [ctx.Process(target=_signer, daemon=True, args=(
        fleet, schedule, len(servers), chunks[s::signers], queues[s], start, results))
        for s in range(signers)]
    addresses = [(server.host, server.port) for server in servers]
    processes.append(ctx.Process(target=_sender, daemon=True, args=(
        addresses, queues, len(chunks), timeout, start, results)))
    for process in processes:
        process.start()
    try:
        for _ in processes:
            start.ready.get(timeout=120)
        start.at.value = time.time() + LEAD
        start.go.set()
        time.sleep(max(0.0, start.at.value + warmup - time.time()))
        warm = probe()
        got: dict[str, Any] = {"signer": 0.0}
        for _ in processes:
            kind, value = results.get(timeout=LEAD + schedule.duration + 3 * timeout + 60)
            got[kind] = got["signer"] + value if kind == "signer" else value
        done = probe()
        for process in processes:
            process.join(timeout=30)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    sent: Sent = got["sender"]
    return Generated(sent, start.at.value, sent.cpu + got["signer"], (warm, done))


# -- the measurements ----------------------------------------------------------------------------


#: How long the commit count waits for the servers' backends to exit (``commits``).
SETTLE = 30.0


def percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else math.nan


def simulate(url: str, fleet: Fleet, interval: float, duration: float,
             servers: int, signers: int, workdir: Path, env: dict[str, str] | None = None,
             warmup: float = 2.0) -> dict[str, Any]:
    """One run: ``servers`` server processes, the ``fleet``'s agents at ``interval`` for
    ``duration`` seconds; the figures (see the module's docstring), by name.

    The same load runs ``warmup`` seconds before, not measured: a server starts its
    BMDB session and fills its connection pool at its first heartbeats."""
    schedule = Schedule.spread(len(fleet.numbers), interval, warmup + duration)
    before_commits = commits(url, others_gone_within=SETTLE)
    with contextlib.ExitStack() as stack:
        running = [stack.enter_context(serve(url, workdir, f"server-{k}", env))
                   for k in range(servers)]
        postgres_pid = running[0].postgres

        def probe() -> tuple[float, float]:
            return (sum(cpu_seconds(server.pid) for server in running),
                    cpu_seconds(postgres_pid, children=True) if postgres_pid else math.nan)

        generated = generate(running, fleet, schedule, signers, warmup, probe)
    # Over the warm-up too: see below.
    committed = commits(url, others_gone_within=SETTLE) - before_commits
    every = generated.sent.heartbeats
    measured = [h for h in every if h[0] >= warmup]
    outcomes = Counter(outcome for *_, outcome in measured)
    accepted = outcomes.pop("200", 0)
    per = 1000 / max(accepted, 1)
    (server_before, postgres_before), (server_after, postgres_after) = generated.probed
    elapsed = max(generated.sent.last_answer - (generated.start + warmup), 1e-9)
    return {
        "machines": fleet.size, "agents": len(fleet.numbers), "interval_s": interval,
        "duration_s": duration, "servers": servers, "signers": signers,
        "offered_per_s": schedule.offered, "sent": len(measured),
        "accepted": accepted, "accepted_per_s": accepted / elapsed, "elapsed_s": elapsed,
        "errors": dict(outcomes),
        "p50_ms": percentile([h[2] for h in measured], 0.5) * 1000,
        "p99_ms": percentile([h[2] for h in measured], 0.99) * 1000,
        "late_p99_ms": percentile([h[1] for h in measured], 0.99) * 1000,
        "late_max_ms": max((h[1] for h in measured), default=math.nan) * 1000,
        # The commits of the servers' whole lives, over every heartbeat they accepted.
        "commits_per_heartbeat": committed / max(
            sum(1 for *_, outcome in every if outcome == "200"), 1),
        "server_cpu_ms_per_heartbeat": (server_after - server_before) * per,
        "postgres_cpu_ms_per_heartbeat": (postgres_after - postgres_before) * per,
        "generator_cpu_ms_per_heartbeat": generated.cpu * 1000 / max(len(every), 1),
    }


def report(figures: dict[str, Any]) -> str:
    f = figures
    errors = ", ".join(f"{k}: {v}" for k, v in sorted(f["errors"].items())) or "none"
    return "\n".join([
        f"{f['machines']} machines, {f['agents']} agents every {f['interval_s']:g}s for "
        f"{f['duration_s']:g}s, "
        f"{f['servers']} server process(es), {f['signers']} signer(s)",
        f"offered {f['offered_per_s']:.0f} hb/s, sent {f['sent']}; generator late p99 "
        f"{f['late_p99_ms']:.1f} ms, max {f['late_max_ms']:.1f} ms",
        f"accepted {f['accepted']} = {f['accepted_per_s']:.0f} hb/s over {f['elapsed_s']:.1f}s; "
        f"errors: {errors}",
        f"latency p50 {f['p50_ms']:.1f} ms, p99 {f['p99_ms']:.1f} ms",
        f"per accepted heartbeat: {f['commits_per_heartbeat']:.3f} PostgreSQL commits; CPU ms "
        f"server {f['server_cpu_ms_per_heartbeat']:.2f}, PostgreSQL "
        f"{f['postgres_cpu_ms_per_heartbeat']:.2f}, generator "
        f"{f['generator_cpu_ms_per_heartbeat']:.2f}",
    ])


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--machines", type=int, default=6000)
    parser.add_argument("--interval", type=float, default=60.0, help="seconds")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of sends")
    parser.add_argument("--warmup", type=float, default=2.0,
                        help="seconds of the same load first, not measured")
    parser.add_argument("--servers", type=int, default=1, help="shepherd serve processes")
    parser.add_argument("--signers", type=int, default=1, help="signing worker processes")
    parser.add_argument("--server-env", nargs="*", default=[], metavar="NAME=VALUE",
                        help="more settings for the servers (SHEPHERD_...)")
    args = parser.parse_args()
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"shepherd-bench-{uuid.uuid4().hex[:8]}"
    env = dict(item.split("=", 1) for item in args.server_env)
    with postgres(args.pg_url) as url:
        fleet = seed(url, args.machines)
        figures = simulate(url, fleet, args.interval, args.duration, args.servers,
                           args.signers, workdir, env, args.warmup)
    print(report(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
