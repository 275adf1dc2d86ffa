"""The Celery app for ``bench.control_plane`` workers: the real tasks, a fake takeover.

``celery -A bench.instant_agent worker ...`` runs every shepherd task unchanged except
the SSH takeover, chosen by ``BENCH_AGENT``:

* ``instant``: no SSH at all; the "agent" answers with a fresh key at once (recorded
  with a new nonce, as a real takeover's). What is
  left is the control plane itself: sourcing, the broker, adoption, the provider
  lookup, the BMDB commits.
* ``instant-nolookup``: as ``instant``, and the provider lookup before it (one API
  call, ~45 ms on the simulator's HTTP server) is skipped too: the Celery + BMDB part
  alone.
* ``banner``: open TCP to the device's SSH port and read its banner, which the
  simulator's ``ssh_latency`` fault delays; then answer at once. I/O-bound like a real
  far-away takeover, without paramiko's CPU cost (this host has 2 cores), so that it
  measures how work spreads over workers rather than how fast crypto runs.

Also ``bench.noop``: the raw Celery baseline on the same broker and worker.

With ``BENCH_PROFILE`` set to a directory, each pool process runs under cProfile (wall
time, or CPU time with ``BENCH_PROFILE_CLOCK=cpu``) and
counts, per task name, the tasks it ran and the BMDB statements, transactions and
Redis commands they cost; it writes ``<pid>.prof`` and ``<pid>.json`` there when it
exits (``bench.control_plane --profile`` reads them).
"""

from __future__ import annotations

import cProfile
import json
import os
import socket
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import bmdb
import shepherd.workflows.initializer as initializer
from shepherd.agent.protocol import new_nonce
from shepherd.providers.base import Provider, ProviderMachine
from shepherd.workflows.common import WorkflowFailure
from shepherd.workflows.initializer import InitializerSettings
from tasks import app

MODE = os.environ.get("BENCH_AGENT", "instant")


BENCH_HOST_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBENCHBENCHBENCHBENCHBENCHBENCHBENCHBENCHBENC"


def instant_takeover(machine: ProviderMachine, machine_id: uuid.UUID,
                     settings: InitializerSettings,
                     pin: initializer.HostKeyPin | None = None, *, answer_key: str,
                     current_key: bytes | None = None) -> initializer.Takeover:
    """The same signature as ``initializer.take_over`` (its BMDB reads still happen)."""
    return initializer.Takeover(os.urandom(32), BENCH_HOST_KEY, new_nonce())


def banner_takeover(machine: ProviderMachine, machine_id: uuid.UUID,
                    settings: InitializerSettings,
                    pin: initializer.HostKeyPin | None = None, *, answer_key: str,
                    current_key: bytes | None = None) -> initializer.Takeover:
    assert machine.address is not None
    with socket.create_connection((machine.address, machine.ssh_port),
                                  timeout=settings.connect_timeout) as conn:
        conn.settimeout(settings.connect_timeout)
        if not conn.recv(64).startswith(b"SSH-"):
            raise WorkflowFailure("bench: no SSH banner")
    return initializer.Takeover(os.urandom(32), BENCH_HOST_KEY, new_nonce())


def known_machine(work: bmdb.Work, provider: Provider, permanent: bmdb.Backoff,
                  provided: dict[str, Any] | None) -> ProviderMachine:
    """The machine from its Provided tag (read with the rest of what AgentStart reads),
    without asking the provider."""
    assert provided is not None
    return ProviderMachine(provided["provider_id"], provided["address"], 22,
                           provided["location"], provided["reservation_id"],
                           bmdb.ProviderStatus.RUNNING, False)


initializer.take_over = banner_takeover if MODE == "banner" else instant_takeover
if MODE == "instant-nolookup":
    initializer.reachable_machine = known_machine


@app.task(name="bench.noop")
def noop() -> None:
    """Nothing at all: what Celery itself costs per task."""


class Profiling:
    """cProfile and round-trip counts of one pool process (``BENCH_PROFILE``)."""

    def __init__(self, directory: Path, clock: str = "wall") -> None:
        self.directory = directory
        self.profiler = (cProfile.Profile(time.process_time) if clock == "cpu"
                         else cProfile.Profile())
        self.task = "(between tasks)"
        #: (what, task name) -> how many: "tasks", "statements", "transactions", "redis".
        self.counts: Counter[tuple[str, str]] = Counter()

    def install(self) -> None:
        import redis.connection
        import sqlalchemy as sa
        from celery.signals import (
            task_postrun,
            task_prerun,
            worker_process_init,
            worker_process_shutdown,
        )
        from sqlalchemy.engine import Engine

        def count(what: str) -> None:
            self.counts[what, self.task] += 1

        sa.event.listen(Engine, "before_cursor_execute", lambda *_: count("statements"))
        sa.event.listen(Engine, "begin", lambda *_: count("transactions"))
        send = redis.connection.Connection.send_packed_command

        def counted(connection: Any, command: Any, check_health: bool = True) -> None:
            count("redis")
            send(connection, command, check_health)

        redis.connection.Connection.send_packed_command = counted  # type: ignore[method-assign]

        def prerun(task: Any = None, **_: Any) -> None:
            self.task = task.name
            count("tasks")

        def postrun(**_: Any) -> None:
            self.task = "(between tasks)"

        task_prerun.connect(prerun, weak=False)
        task_postrun.connect(postrun, weak=False)
        worker_process_init.connect(lambda **_: self.start(), weak=False)
        worker_process_shutdown.connect(lambda **_: self.dump(), weak=False)

    def start(self) -> None:
        self.counts.clear()
        self.profiler.enable()

    def dump(self) -> None:
        self.profiler.disable()
        self.profiler.dump_stats(self.directory / f"{os.getpid()}.prof")
        counts: dict[str, dict[str, int]] = {}
        for (what, task), n in self.counts.items():
            counts.setdefault(task, {})[what] = n
        (self.directory / f"{os.getpid()}.json").write_text(json.dumps(counts))


if os.environ.get("BENCH_PROFILE"):
    Profiling(Path(os.environ["BENCH_PROFILE"]),
              os.environ.get("BENCH_PROFILE_CLOCK", "wall")).install()


__all__ = ["app", "noop"]
