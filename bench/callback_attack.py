"""Honest heartbeats while the agents' TLS listener is under attack, next to none.

One ``shepherd serve`` process with TLS and its default limits, on PostgreSQL (fsync
on). In the same run, a burst of ``--requests`` signed heartbeats from ``--clients``
clients (each heartbeat a new TLS connection, as an agent's every minute) is sent
twice: first alone, then while an attacker process holds

* ``--slow`` connections that completed TLS and trickle their headers one byte a
  second (each gets 408 at the header deadline; the attacker opens another), and
* ``--idle`` TCP connections that never start their TLS handshake (each is closed at
  the handshake timeout; the attacker opens another).

Reported: the honest heartbeats' errors (aim: 0) and p99 latency (aim: <= 500 ms on
a 2-core machine), and how many attack connections were held.

    .venv/bin/python -m bench.callback_attack [--pg-url URL] [--requests 2000] [--clients 64]
        [--slow 200] [--idle 20] [--json FILE]
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import ssl
import time
import uuid
from multiprocessing.sharedctypes import SynchronizedArray
from multiprocessing.synchronize import Event
from pathlib import Path

from bench.common import arguments, postgres
from bench.heartbeat_ingest import HEADER, load, seed, serve, sign, summary
from tests.support.servers import self_signed


async def _slow(host: str, port: int, tls: ssl.SSLContext, stop: Event,
                held: list[int]) -> None:
    """One slow-header connection at a time, for ever: trickle until answered."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port, ssl=tls,
                                                           server_hostname=host)
        except OSError:
            await asyncio.sleep(0.5)
            continue
        held[0] += 1
        try:
            writer.write(b"POST /agent/v1/heartbeat HTTP/1.1\r\nHost: x\r\nX-Slow")
            while not stop.is_set() and not reader.at_eof():
                writer.write(b"w")
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    if await asyncio.wait_for(reader.read(4096), 1.0) == b"":
                        break
        except (OSError, ssl.SSLError):
            pass
        finally:
            held[0] -= 1
            writer.close()


async def _idle(host: str, port: int, stop: Event, held: list[int]) -> None:
    """One TCP connection at a time that never says a word, for ever."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(0.5)
            continue
        held[1] += 1
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    if await asyncio.wait_for(reader.read(4096), 1.0) == b"":
                        break
        except OSError:
            pass
        finally:
            held[1] -= 1
            writer.close()


def attack(host: str, port: int, ca_file: str, slow: int, idle: int, stop: Event,
           ready: Event, peak: SynchronizedArray[int]) -> None:
    """The attacker process: hold ``slow`` and ``idle`` connections until ``stop``."""
    tls = ssl.create_default_context(cafile=ca_file)
    held = [0, 0]

    async def run() -> None:
        tasks = [asyncio.create_task(_slow(host, port, tls, stop, held)) for _ in range(slow)]
        tasks += [asyncio.create_task(_idle(host, port, stop, held)) for _ in range(idle)]
        while not stop.is_set():
            if held[0] >= slow and held[1] >= idle:
                ready.set()
            peak[0], peak[1] = max(peak[0], held[0]), max(peak[1], held[1])
            await asyncio.sleep(0.1)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--slow", type=int, default=200)
    parser.add_argument("--idle", type=int, default=20)
    args = parser.parse_args()
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"shepherd-attack-{uuid.uuid4().hex[:8]}"
    workdir.mkdir(parents=True)
    cert, key = self_signed(workdir)
    env = {"SHEPHERD_SERVE_TLS_CERT": cert, "SHEPHERD_SERVE_TLS_KEY": key}
    context = multiprocessing.get_context("spawn")
    with postgres(args.pg_url) as url:
        agents = seed(url, args.requests)
        with serve(url, workdir, "serve", env) as server:
            host, port = server.host, server.port
            load([server], sign(agents, 200, args.clients), cert)  # warm up
            calm = load([server], sign(agents, args.requests, args.clients), cert)
            stop, ready = context.Event(), context.Event()
            peak = context.Array("i", 2)
            attacker = context.Process(target=attack, args=(host, port, cert, args.slow,
                                                            args.idle, stop, ready, peak))
            attacker.start()
            try:
                if not ready.wait(120):
                    raise SystemExit("the attacker could not open its connections")
                time.sleep(1)
                attacked = load([server], sign(agents, args.requests, args.clients), cert)
            finally:
                stop.set()
                attacker.join(30)
    print(HEADER)
    print(calm.line("honest heartbeats alone"))
    print(attacked.line(f"... with {args.slow} slow + {args.idle} idle"))
    print(f"attack connections held at once: {peak[0]} slow-header, {peak[1]} idle TCP "
          f"(aims: 0 errors, p99 <= 500 ms)")
    if args.json:
        args.json.write_text(json.dumps({
            "alone": summary(calm), "attacked": summary(attacked),
            "held": {"slow": peak[0], "idle": peak[1]}}, indent=1))


if __name__ == "__main__":
    main()
