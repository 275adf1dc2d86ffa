"""Read-only queries: a machine's tags and history, agent credentials, fleet counts."""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from bmdb import backlog, schema
from bmdb.database import Tx
from bmdb.processes import Process
from bmdb.work import eligible

TAG_TABLES: dict[str, sa.Table] = {
    "Provided": schema.provided,
    "AgentStarted": schema.agent_started,
    "AgentHeartbeat": schema.agent_heartbeat,
    "HardwareReport": schema.hardware_report,
    "OSInstallationRequest": schema.os_installation_request,
    "OSInstallationReport": schema.os_installation_report,
}


def machine_exists(tx: Tx, machine_id: uuid.UUID) -> bool:
    query = sa.select(sa.literal(True)).where(schema.machines.c.id == machine_id)
    return tx.execute(query).scalar_one_or_none() is not None


def machine_tags(tx: Tx, machine_id: uuid.UUID) -> dict[str, dict[str, Any]]:
    """Every tag the machine has, by tag name, as column -> value."""
    tags = {}
    for name in TAG_TABLES:
        tag = machine_tag(tx, name, machine_id)
        if tag is not None:
            tags[name] = tag
    return tags


def machine_tag(tx: Tx, name: str, machine_id: uuid.UUID) -> dict[str, Any] | None:
    """One tag of the machine (``TAG_TABLES`` names them) as column -> value, or None.

    For the per-machine workflows, which need one tag per step: a whole
    ``machine_tags`` is a query per tag table.
    """
    row = tx.execute(_TAG_QUERIES[name], {"machine": machine_id}).one_or_none()
    return None if row is None else {k: v for k, v in row._mapping.items() if k != "machine_id"}


#: Built once (see ``backlog.Backlog`` for why).
_TAG_QUERIES = {name: sa.select(table).where(table.c.machine_id == sa.bindparam("machine"))
                for name, table in TAG_TABLES.items()}


def history(tx: Tx, machine_id: uuid.UUID, limit: int = 100) -> list[dict[str, Any]]:
    """The machine's work history, newest first."""
    h = schema.history
    rows = tx.execute(
        sa.select(h).where(h.c.machine_id == machine_id).order_by(h.c.id.desc()).limit(limit)
    )
    return [dict(row._mapping) for row in rows]


def provided_by_provider_id(tx: Tx, provider: str) -> dict[str, uuid.UUID]:
    """provider id -> machine id, for every machine the BMDB has from ``provider``."""
    p = schema.provided
    rows = tx.execute(sa.select(p.c.provider_id, p.c.machine_id).where(p.c.provider == provider))
    return {row.provider_id: row.machine_id for row in rows}


@dataclass(frozen=True)
class AgentCredentials:
    public_key: bytes
    last_signed_at: dt.datetime | None


def agent_credentials(tx: Tx, machine_id: uuid.UUID) -> AgentCredentials | None:
    """The key a heartbeat must be signed with, and the newest timestamp already accepted."""
    s, h = schema.agent_started, schema.agent_heartbeat
    row = tx.execute(
        sa.select(s.c.public_key, h.c.last_signed_at)
        .select_from(s.outerjoin(h, h.c.machine_id == s.c.machine_id))
        .where(s.c.machine_id == machine_id)
    ).one_or_none()
    return None if row is None else AgentCredentials(row.public_key, row.last_signed_at)


def pending_os_installation(tx: Tx, machine_id: uuid.UUID) -> dict[str, Any] | None:
    """The installation request the agent has not reported on yet, if any."""
    q, r = schema.os_installation_request, schema.os_installation_report
    row = tx.execute(
        sa.select(q.c.generation, q.c.request, r.c.generation.label("reported"))
        .select_from(q.outerjoin(r, r.c.machine_id == q.c.machine_id))
        .where(q.c.machine_id == machine_id)
    ).one_or_none()
    if row is None or row.reported == row.generation:
        return None
    return {"generation": row.generation, "request": row.request}


@dataclass(frozen=True)
class FleetCounts:
    machines: int
    provided: int
    agent_started: int
    heartbeating: int
    backlog: dict[str, int]
    active_work: dict[str, int]
    active_backoffs: dict[str, int]


def fleet_counts(tx: Tx, thresholds: backlog.Thresholds) -> FleetCounts:
    """What an operator wants on one screen; the backlog counts what is claimable now.

    Counts whole tables: for dashboards and metrics, not for hot paths.
    """

    def count(query: sa.Select) -> int:
        return tx.execute(sa.select(sa.func.count()).select_from(query.subquery())).scalar_one()

    def per_process(table: sa.Table, *where: sa.ColumnElement[bool]) -> dict[str, int]:
        rows = tx.execute(
            sa.select(table.c.process, sa.func.count()).where(*where).group_by(table.c.process)
        )
        found = {row[0]: row[1] for row in rows}
        return {p.value: found.get(p.value, 0) for p in Process}

    hb = schema.agent_heartbeat
    fresh = tx.execute(
        sa.select(sa.func.count()).where(
            hb.c.last_heartbeat_at >= tx.now - dt.timedelta(seconds=thresholds.heartbeat)
        )
    ).scalar_one()
    return FleetCounts(
        machines=count(sa.select(schema.machines.c.id)),
        provided=count(sa.select(schema.provided.c.machine_id)),
        agent_started=count(sa.select(schema.agent_started.c.machine_id)),
        heartbeating=fresh,
        backlog={
            process.value: count(eligible(tx, process, backlog.retriever(process, thresholds)))
            for process in (Process.AGENT_START, Process.RECOVERY)
        },
        active_work=per_process(schema.work),
        active_backoffs=per_process(schema.backoff, schema.backoff.c.until > tx.now),
    )
