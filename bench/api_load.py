"""Agents' heartbeats while operators use the API: one ``shepherd serve`` process, one
PostgreSQL (fsync on), heartbeats at a steady rate, alone and then beside ``--clients``
API clients that each read ``GET /api/v1/machines`` (500 rows) and a machine's page
(``GET /api/v1/machines/{id}``) back to back, as fast as they are answered.

Figures, from one run: the heartbeats' p50/p99 alone and beside the clients (the
issue's aim: p99 under 500 ms beside 20 clients), the API's answers per second and
their median. The heartbeats are ``bench.heartbeat_ingest``'s (real, signed, each on a
new connection, from a process of their own); the API clients run in another process.

    .venv/bin/python -m bench.api_load [--pg-url URL] [--machines 2048] [--rate 200]
        [--seconds 20] [--clients 20] [--json FILE]
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

import bmdb
from bench.common import arguments, postgres
from bench.heartbeat_ingest import Outcome, Server, load, seed, serve, sign, summary
from shepherd.operations import tokens
from shepherd.roles import Role

#: The issue's aim for the heartbeats' p99 beside the API clients.
AIM_P99_MS = 500.0


@dataclass(frozen=True)
class ApiLoad:
    """What the API clients saw: answers, refusals, and the latencies of the answers."""

    answered: int
    failed: int
    seconds: float
    latencies: list[float]

    @property
    def rate(self) -> float:
        return self.answered / self.seconds

    @property
    def median_ms(self) -> float:
        return statistics.median(self.latencies) * 1000 if self.latencies else float("nan")


def _client(base: str, token: str, machine: str, stop: threading.Event,
            seen: list[tuple[int, float]]) -> None:
    http = requests.Session()
    http.headers["Authorization"] = f"Bearer {token}"
    paths = ("/api/v1/machines?limit=500", f"/api/v1/machines/{machine}")
    n = 0
    while not stop.is_set():
        started = time.perf_counter()
        status = http.get(base + paths[n % 2], timeout=60).status_code
        seen.append((status, time.perf_counter() - started))
        n += 1


def _clients(base: str, token: str, machine: str, clients: int, seconds: float
             ) -> ApiLoad:
    """``clients`` threads for ``seconds`` (in a process of its own: ``run_clients``)."""
    stop = threading.Event()
    seen: list[tuple[int, float]] = []
    threads = [threading.Thread(target=_client, args=(base, token, machine, stop, seen))
               for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    answered = [latency for status, latency in seen if status == 200]
    return ApiLoad(len(answered), len(seen) - len(answered), time.perf_counter() - started,
                   answered)


def heartbeats_beside(server: Server, per_client: list[list[Any]], rate: float,
                      api: tuple[str, str, str, int, float] | None
                      ) -> tuple[Outcome, ApiLoad | None]:
    """The heartbeats at ``rate``, with the API clients running meanwhile (``api``)."""
    if api is None:
        return load([server], per_client, rate=rate), None
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        clients = pool.apply_async(_clients, api)
        time.sleep(1.0)  # the clients under way before the first heartbeat
        outcome = load([server], per_client, rate=rate)
        return outcome, clients.get()


def _latencies(outcome: Outcome) -> str:
    return (f"p50 {statistics.median(outcome.latencies) * 1000:.1f} ms, p99 "
            f"{outcome.percentile(0.99):.1f} ms, {outcome.errors} errors")


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--machines", type=int, default=2048)
    parser.add_argument("--rate", type=float, default=200.0, help="heartbeats per second")
    parser.add_argument("--seconds", type=float, default=20.0, help="per measurement")
    parser.add_argument("--clients", type=int, default=20, help="concurrent API clients")
    args = parser.parse_args()
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"shepherd-bench-{uuid.uuid4().hex[:8]}"
    count = max(1, int(args.rate * args.seconds))
    with postgres(args.pg_url) as url:
        agents = seed(url, args.machines)
        db = bmdb.connect(url)
        with db.start_session("bench", interval=30) as session:
            token, _ = tokens.create(session, "bench", Role.VIEWER, None, "bench")
        db.close()
        load([], [])  # the spawn machinery started outside the clock
        with serve(url, workdir, "api-load") as server:
            base = f"http://{server.host}:{server.port}"
            load([server], sign(agents, 300, 16))  # warm up
            alone, _ = heartbeats_beside(server, sign(agents, count, 16), args.rate, None)
            api = (base, token, str(agents[0].machine), args.clients, args.seconds + 2)
            beside, clients = heartbeats_beside(server, sign(agents, count, 16), args.rate,
                                                api)
    assert clients is not None
    print(f"heartbeats at {args.rate:g}/s alone: {_latencies(alone)}")
    print(f"beside {args.clients} API clients: {_latencies(beside)} (aim: p99 < "
          f"{AIM_P99_MS:g} ms)")
    print(f"API: {clients.rate:.0f} answers/s, median {clients.median_ms:.1f} ms, "
          f"{clients.failed} not 200")
    if args.json:
        args.json.write_text(json.dumps({
            "heartbeats_alone": summary(alone), "heartbeats_beside_api": summary(beside),
            "api_answers_per_s": clients.rate, "api_median_ms": clients.median_ms,
            "api_failed": clients.failed, "api_clients": args.clients}, indent=1))


if __name__ == "__main__":
    main()
