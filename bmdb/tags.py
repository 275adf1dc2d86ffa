"""Tags: what the BMDB knows about a machine, one table per tag.

This module is the only writer of tag tables, because it keeps the backlog
markers (``provided.agent_started``, ``agent_started.heartbeat_seen``, see
``schema.py``) in step with the tags they mirror, in the same transaction.
"""

from __future__ import annotations

import base64
import datetime as dt
import functools
import secrets
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from bmdb import _schema as schema
from bmdb._database import Tx
from bmdb.vocabulary import ProviderStatus

#: Bounds of an agent's nonce (base64 text; 44 characters for the 32 bytes
#: ``shepherd.agent.protocol.new_nonce`` makes), within ``agent_started.nonce``.
MIN_NONCE, MAX_NONCE = 16, 64


def upsert(
    tx: Tx, table: sa.Table, key: Mapping[str, Any], values: Mapping[str, Any],
    *, markers: tuple[str, ...] = (),
) -> None:
    """INSERT, or UPDATE on a conflict over ``key``: one statement on either backend.

    ``markers`` are written only by the INSERT, never by the UPDATE. A marker's
    value is an EXISTS over another tag (``MARKED_BY``), read from the statement's
    snapshot; on PostgreSQL at READ COMMITTED that snapshot predates the row lock
    the UPDATE may wait for, so an UPDATE would write back a value a concurrent
    writer of that tag (who holds the lock and moves the marker with ``_mark``) has
    just changed. Once the row exists, only ``_mark`` moves its markers.
    """
    statement = _upsert_statement(tx.dialect, table, tuple(key), tuple(values), markers)
    tx.execute(statement, {**key, **values})


#: Marker column -> the tag table whose rows it mirrors (for the machine of the row).
MARKED_BY = {"agent_started": schema.agent_started, "heartbeat_seen": schema.agent_heartbeat}


@functools.cache
def _upsert_statement(dialect: str, table: sa.Table, key: tuple[str, ...],
                      columns: tuple[str, ...], markers: tuple[str, ...]) -> sa.Insert:
    """The statement of ``upsert``, built once per shape (see ``backlog.Backlog`` for why)."""
    dialect_insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    values: dict[str, Any] = {name: sa.bindparam(name, type_=table.c[name].type)
                              for name in key + columns}
    for name in markers:
        values[name] = _has_tag(MARKED_BY[name], sa.bindparam("machine_id"))
    statement = dialect_insert(table).values(values)
    return statement.on_conflict_do_update(
        index_elements=list(key), set_={name: statement.excluded[name] for name in columns})


def create_machine(tx: Tx, machine_id: uuid.UUID | None = None) -> uuid.UUID:
    machine_id = machine_id or uuid.uuid4()
    tx.execute(sa.insert(schema.machines).values(id=machine_id, created_at=tx.now))
    return machine_id


def delete_machine(tx: Tx, machine_id: uuid.UUID) -> None:
    """Delete a machine and its tags; refused (IntegrityError) while work holds it."""
    tx.execute(sa.delete(schema.machines).where(schema.machines.c.id == machine_id))


def upsert_provided(
    tx: Tx,
    machine_id: uuid.UUID,
    *,
    provider: str,
    provider_id: str,
    provider_status: ProviderStatus | str,
    reservation_id: str | None = None,
    address: str | None = None,
    location: str | None = None,
) -> None:
    upsert(
        tx,
        schema.provided,
        {"machine_id": machine_id},
        {
            "provider": provider,
            "provider_id": provider_id,
            "reservation_id": reservation_id,
            "address": address,
            "location": location,
            "provider_status": ProviderStatus(provider_status).value,
            "updated_at": tx.now,
        },
        markers=("agent_started",),
    )


def set_provider_status(tx: Tx, machine_ids: Iterable[uuid.UUID],
                        status: ProviderStatus | str) -> int:
    """Set the provider status of the machines' Provided tags in one statement (for
    tools and benchmarks that move many machines at once); returns how many changed.
    No marker depends on the status, so none moves."""
    p = schema.provided
    return tx.execute(
        sa.update(p).where(p.c.machine_id.in_(list(machine_ids)))
        .values(provider_status=ProviderStatus(status).value, updated_at=tx.now)
    ).rowcount


#: The columns of a Provided tag that say what its provider sees (``refresh_provided``).
PROVIDER_VIEW = ("reservation_id", "address", "location", "provider_status")


def refresh_provided(tx: Tx, views: sa.FromClause, *, written_before: dt.datetime) -> int:
    """Write ``views`` (rows of ``machine_id``, ``provider_id`` and the ``PROVIDER_VIEW``
    columns, from a query) to the machines' Provided tags in one statement, each only
    where it differs from the tag as it is now; return how many tags were written.

    For the updater's batches (``bmdb.listing``). Only tags written before
    ``written_before`` are touched: the caller read them then, as tags of its
    provider, and any tag registered or rewritten since (whatever its provider) is
    left alone, as possibly newer than the caller's listing. Skipped too: machines
    deleted meanwhile (an UPDATE finds no row, so no tag is re-created), another
    provider id, tags equal already. Only the view and ``updated_at`` change, never a
    marker. (No condition on ``provider``: SQLite, without statistics, would then
    walk every tag of the provider through that index instead of the batch's rows.)
    """
    p = schema.provided
    differs = sa.or_(*(p.c[name].is_distinct_from(views.c[name]) for name in PROVIDER_VIEW))
    statement = (
        sa.update(p)
        .where(p.c.machine_id == views.c.machine_id, p.c.provider_id == views.c.provider_id,
               p.c.updated_at < written_before, differs)
        .values({**{name: views.c[name] for name in PROVIDER_VIEW}, "updated_at": tx.now})
    )
    return tx.execute(statement).rowcount


def mark_provided_missing(tx: Tx, machines: sa.FromClause, *,
                          written_before: dt.datetime) -> int:
    """Set ``Missing`` on the Provided tags of ``machines`` (rows of ``machine_id``, from
    a query) in one statement, keeping their last reservation, address and location;
    return how many were written. Skipped as in ``refresh_provided``, and tags that
    are ``Missing`` already."""
    p = schema.provided
    missing = ProviderStatus.MISSING.value
    statement = (
        sa.update(p)
        .where(p.c.machine_id == machines.c.machine_id, p.c.provider_status != missing,
               p.c.updated_at < written_before)
        .values(provider_status=missing, updated_at=tx.now)
    )
    return tx.execute(statement).rowcount


def delete_provided(tx: Tx, machine_id: uuid.UUID) -> None:
    """The machine is no longer known at a provider; its other tags stay (and say so)."""
    _delete(tx, schema.provided, machine_id)


def set_agent_started(
    tx: Tx, machine_id: uuid.UUID, public_key: bytes, nonce: str | None = None,
    started_at: dt.datetime | None = None,
) -> None:
    """Record the agent of a takeover: its key and the nonce it was given.

    Invariant: every call writes a new nonce (the takeover's, or else a random
    one no agent was given), never keeps the row's old one. Heartbeat signatures
    cover the nonce, so nothing signed for an earlier takeover verifies after this
    (see ``queries.lock_agent_credentials``).
    """
    if len(public_key) != 32:
        raise ValueError(f"agent public key must be 32 bytes (ed25519), got {len(public_key)}")
    if nonce is None:
        nonce = base64.b64encode(secrets.token_bytes(32)).decode()
    if not MIN_NONCE <= len(nonce) <= MAX_NONCE:
        raise ValueError(f"agent nonce must be {MIN_NONCE}..{MAX_NONCE} characters, "
                         f"got {len(nonce)}")
    upsert(
        tx,
        schema.agent_started,
        {"machine_id": machine_id},
        {"started_at": started_at or tx.now, "public_key": public_key, "nonce": nonce},
        markers=("heartbeat_seen",),
    )
    _mark(tx, schema.provided, machine_id, agent_started=True)


def delete_agent_started(tx: Tx, machine_id: uuid.UUID) -> None:
    _delete(tx, schema.agent_started, machine_id)
    _mark(tx, schema.provided, machine_id, agent_started=False)


def forget_every_agent(tx: Tx) -> list[uuid.UUID]:
    """Drop every machine's AgentStarted and AgentHeartbeat; returns those machines.

    For a fleet whose every agent is known gone at once (``shepherd up``'s embedded
    machines stop with it): each machine is back in the AgentStart backlog, instead of
    all of them going silent together, which the Recovery guard rightly reads as a
    network failure and pauses on. One statement per machine, as the counters'
    triggers and markers expect; a demo fleet is small.
    """
    started = [row.machine_id for row in tx.execute(
        sa.select(schema.agent_started.c.machine_id).order_by(
            schema.agent_started.c.machine_id))]
    for machine_id in started:
        delete_heartbeat(tx, machine_id)
        delete_agent_started(tx, machine_id)
    return started


class Beat(NamedTuple):
    """One machine's heartbeat to record: the newest accepted signed timestamp, and
    whether ``heartbeat_seen`` was read already set under the AgentStarted row's lock."""

    machine_id: uuid.UUID
    signed_at: dt.datetime
    marked: bool = False


def record_heartbeat(tx: Tx, machine_id: uuid.UUID, signed_at: dt.datetime, *,
                     marked: bool = False) -> None:
    record_heartbeats(tx, [Beat(machine_id, signed_at, marked)])


def record_heartbeats(tx: Tx, beats: Sequence[Beat]) -> None:
    """Record each machine's heartbeat (one ``Beat`` per machine) at ``tx.now``.

    ``marked``: the caller read ``heartbeat_seen`` already set while holding the
    AgentStarted row's lock (``queries.lock_agent_credentials``), so nobody can
    have cleared it since: the marker's UPDATE is skipped, and since the marker says
    the AgentHeartbeat row exists, a plain UPDATE of it is enough. That keeps the
    hot path clear of the INSERT triggers an upsert fires even when it only updates
    (``counters``). Each kind goes as one executemany, which the PostgreSQL engine
    sends as one round trip (``_database.create_engine``): the marked beats' UPDATE;
    for the first beats (after a takeover or a Recovery, whole racks at once), their
    upsert and their markers' UPDATE, so a batch costs at most three statements
    however many machines it holds.
    """
    marked = [{"beating": b.machine_id, "last_heartbeat_at": tx.now,
               "last_signed_at": b.signed_at} for b in beats if b.marked]
    if marked:
        tx.execute(_HEARTBEAT_UPDATE, marked)
    first = [b for b in beats if not b.marked]
    if first:
        statement = _upsert_statement(tx.dialect, schema.agent_heartbeat, ("machine_id",),
                                      ("last_heartbeat_at", "last_signed_at"), ())
        tx.execute(statement, [{"machine_id": b.machine_id, "last_heartbeat_at": tx.now,
                                "last_signed_at": b.signed_at} for b in first])
        tx.execute(_mark_statement(schema.agent_started, "heartbeat_seen", True),
                   [{"marked": b.machine_id} for b in first])


_HEARTBEAT_UPDATE = (sa.update(schema.agent_heartbeat)
                     .where(schema.agent_heartbeat.c.machine_id == sa.bindparam("beating")))


def delete_heartbeat(tx: Tx, machine_id: uuid.UUID) -> None:
    _delete(tx, schema.agent_heartbeat, machine_id)
    _mark(tx, schema.agent_started, machine_id, heartbeat_seen=False)


#: The longest hostname kept from a report (``hardware_report.hostname``).
MAX_HOSTNAME = 255


def set_hardware_report(tx: Tx, machine_id: uuid.UUID, report: Mapping[str, Any]) -> None:
    """Store ``report``, and beside it its hostname (``report_hostname``): what list
    pages show per row, read from a column so that no page parses a report."""
    upsert(
        tx, schema.hardware_report, {"machine_id": machine_id},
        {"reported_at": tx.now, "report": dict(report),
         "hostname": report_hostname(report)},
    )


def report_hostname(report: Mapping[str, Any]) -> str | None:
    """The report's top-level ``hostname`` when it is a string, cut to ``MAX_HOSTNAME``
    characters; None otherwise, and None for text a database column cannot hold (NUL,
    lone surrogates: PostgreSQL refuses both), which a report's JSON may still carry.
    Kept as stored otherwise: readers make it printable."""
    hostname = report.get("hostname")
    if not isinstance(hostname, str) or "\x00" in hostname:
        return None
    try:
        hostname.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return hostname[:MAX_HOSTNAME]


def delete_hardware_report(tx: Tx, machine_id: uuid.UUID) -> None:
    _delete(tx, schema.hardware_report, machine_id)


def set_os_installation_request(
    tx: Tx, machine_id: uuid.UUID, generation: int, request: Mapping[str, Any]
) -> None:
    upsert(
        tx, schema.os_installation_request, {"machine_id": machine_id},
        {"generation": generation, "request": dict(request)},
    )


def set_os_installation_report(
    tx: Tx, machine_id: uuid.UUID, generation: int, result: Mapping[str, Any]
) -> None:
    upsert(
        tx, schema.os_installation_report, {"machine_id": machine_id},
        {"generation": generation, "reported_at": tx.now, "result": dict(result)},
    )


def delete_os_installation_request(tx: Tx, machine_id: uuid.UUID) -> None:
    _delete(tx, schema.os_installation_request, machine_id)


def delete_os_installation_report(tx: Tx, machine_id: uuid.UUID) -> None:
    _delete(tx, schema.os_installation_report, machine_id)


def _delete(tx: Tx, table: sa.Table, machine_id: uuid.UUID) -> None:
    tx.execute(sa.delete(table).where(table.c.machine_id == machine_id))


def _has_tag(table: sa.Table, machine_id: Any) -> sa.Exists:
    """The marker's value, computed inside the statement that writes it (no extra round trip)."""
    return sa.exists().where(table.c.machine_id == machine_id)


def _mark(tx: Tx, table: sa.Table, machine_id: uuid.UUID, **marker: bool) -> None:
    ((column, value),) = marker.items()
    tx.execute(_mark_statement(table, column, value), {"marked": machine_id})


@functools.cache
def _mark_statement(table: sa.Table, column: str, value: bool) -> sa.Update:
    # Write only on change: a heartbeat every few seconds must not rewrite the row.
    return (sa.update(table)
            .where(table.c.machine_id == sa.bindparam("marked"), table.c[column] != value)
            .values({column: value}))
