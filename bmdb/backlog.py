"""Backlog queries: which machines need a process now.

Each query reads only the machines in its backlog, through the marker columns
and partial indexes described in ``schema.py``, so an idle poll costs the same
at 1k machines as at 1M (``bench/backlog_latency.py`` measures it).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa

from bmdb import schema
from bmdb.database import Tx
from bmdb.processes import Process
from bmdb.tags import ProviderStatus


@dataclass(frozen=True)
class Thresholds:
    """When a started agent counts as silent (seconds); configurable so tests can use seconds."""

    #: A new agent must send its first heartbeat within this long of its start.
    first_heartbeat: float = 30 * 60
    #: After that, a heartbeat older than this means the agent went quiet.
    heartbeat: float = 10 * 60


def agent_start(tx: Tx) -> sa.Select:
    """Running at the provider, and no agent started yet."""
    p = schema.provided
    return sa.select(p.c.machine_id).where(
        ~p.c.agent_started, p.c.provider_status == ProviderStatus.RUNNING.value
    )


def recovery(tx: Tx, thresholds: Thresholds) -> sa.CompoundSelect:
    """Agent started, but no heartbeat soon enough after start, or none lately."""
    s, h = schema.agent_started, schema.agent_heartbeat
    never_heard = sa.select(s.c.machine_id).where(
        ~s.c.heartbeat_seen,
        s.c.started_at < tx.now - dt.timedelta(seconds=thresholds.first_heartbeat),
    )
    gone_quiet = (
        sa.select(h.c.machine_id)
        .join(s, s.c.machine_id == h.c.machine_id)
        .where(h.c.last_heartbeat_at < tx.now - dt.timedelta(seconds=thresholds.heartbeat))
    )
    return sa.union_all(never_heard, gone_quiet)


def retriever(process: Process, thresholds: Thresholds) -> Callable[[Tx], sa.Select]:
    """The backlog query of ``process`` as a claim retriever."""
    process = Process(process)
    if process is Process.AGENT_START:
        return agent_start
    if process is Process.RECOVERY:
        return lambda tx: recovery(tx, thresholds)
    raise ValueError(f"{process} has no backlog query; claim it with a retriever of your own")
