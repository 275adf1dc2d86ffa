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
"""

from __future__ import annotations

import os
import socket
import uuid
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


__all__ = ["app", "noop"]
