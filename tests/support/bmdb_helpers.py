"""Small helpers for BMDB tests: seeding machines and reading history."""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass

import sqlalchemy as sa

import bmdb


def seed_provided(session: bmdb.Session, count: int, status: str = "Running") -> list[uuid.UUID]:
    """``count`` machines with a Provided tag, in one transaction."""

    def body(tx: bmdb.Tx) -> list[uuid.UUID]:
        ids = []
        for _ in range(count):
            machine_id = bmdb.create_machine(tx)
            bmdb.upsert_provided(
                tx, machine_id, provider="test", provider_id=str(machine_id),
                provider_status=status, address="127.0.0.1",
            )
            ids.append(machine_id)
        return ids

    return session.transact(body)


def start_agent(session: bmdb.Session, machine_id: uuid.UUID) -> None:
    session.transact(lambda tx: bmdb.set_agent_started(tx, machine_id, b"\x01" * 32))


def events(db: bmdb.BMDB, machine_id: uuid.UUID) -> list[tuple[str, str]]:
    """(process, event) of the machine's history, oldest first."""
    rows = db.read(lambda tx: bmdb.machine_history(tx, machine_id))
    return [(row["process"], row["event"]) for row in reversed(rows)]


def backlog_ids(session: bmdb.Session, process: bmdb.Process) -> set[uuid.UUID]:
    """What a claim could take right now (backlog minus busy and backing-off machines)."""
    retriever = bmdb.retriever(process, session.db.thresholds)

    def body(tx: bmdb.Tx) -> set[uuid.UUID]:
        return set(tx.execute(bmdb.eligible(tx, process, retriever)).scalars())

    return session.transact(body)


def stored_interval(db: bmdb.BMDB, machine_id: uuid.UUID, process: bmdb.Process) -> int | None:
    b = bmdb._schema.backoff
    query = sa.select(b.c.interval_s).where(b.c.machine_id == machine_id, b.c.process == process)
    return db.read(lambda tx: tx.execute(query).scalar_one_or_none())


def claim_for(session: bmdb.Session, process: bmdb.Process, machine_id: uuid.UUID) -> bmdb.Work:
    """A claim of ``machine_id`` for ``process``, whatever its backlog says."""
    return session.claim(process, lambda tx: sa.select(sa.literal(machine_id, sa.Uuid)))[0]


@dataclass(frozen=True)
class HealthFleet:
    """One machine of each health (``bmdb.HealthCounts``), and what each health link
    must list, by the web view's link keys. Thresholds: first heartbeat 60 s,
    heartbeat 30 s (the ``db`` fixture's)."""

    machines: dict[str, uuid.UUID]
    expected: dict[str, set[uuid.UUID]]


def seed_health_fleet(session: bmdb.Session) -> HealthFleet:
    """Eight machines: ``plain`` (Provided only: in no health), ``heartbeating``,
    ``silent`` (agent started 2 h ago, never heard), ``recovering`` (heard 10 min ago,
    held by Recovery work: silent too), ``installing`` (at a step, heard 10 min ago:
    not silent), ``withdrawn`` (heartbeating, its installation withdrawn while its
    OSInstall work still holds it), ``held`` (silent but in maintenance: neither),
    ``backing_off`` (its AgentStart failed)."""
    names = ("plain", "heartbeating", "silent", "recovering", "installing", "withdrawn",
             "held", "backing_off")
    m = dict(zip(names, seed_provided(session, len(names)), strict=True))
    session.claim_machine(bmdb.Process.AGENT_START, m["backing_off"]).fail("ssh: refused")
    installs = claim_for(session, bmdb.Process.OS_INSTALL, m["withdrawn"])
    session.transact(lambda tx: _health_rows(tx, m))
    claim_for(session, bmdb.Process.RECOVERY, m["recovering"])
    assert installs.machine_id == m["withdrawn"]
    expected = {"heartbeating": {m["heartbeating"], m["withdrawn"]},
                "silent": {m["silent"], m["recovering"]}, "in-recovery": {m["recovering"]},
                "installing": {m["installing"], m["withdrawn"]}, "held": {m["held"]},
                "backing-off": {m["backing_off"]}}
    return HealthFleet(m, expected)


def _health_rows(tx: bmdb.Tx, m: dict[str, uuid.UUID]) -> None:
    long_ago, lately = tx.now - dt.timedelta(hours=2), tx.now - dt.timedelta(minutes=10)
    for name in ("heartbeating", "silent", "recovering", "installing", "withdrawn", "held"):
        bmdb.set_agent_started(tx, m[name], b"\x01" * 32, started_at=long_ago)
    for name in ("heartbeating", "recovering", "installing", "withdrawn"):
        bmdb.record_heartbeat(tx, m[name], tx.now)
    h = bmdb._schema.agent_heartbeat
    tx.execute(sa.update(h).where(h.c.machine_id.in_([m["recovering"], m["installing"]]))
               .values(last_heartbeat_at=lately))
    for name in ("installing", "withdrawn"):
        bmdb.want_installation(tx, m[name], image="debian-12", disk="serial=X", origin="operator",
                               by="test", reason="test")
        bmdb.dispatch_installation(tx, m[name], {"image": {"name": "debian-12"}, "disk": "x"})
    bmdb.withdraw_installation(tx, m["withdrawn"], by="test", reason="changed my mind")
    bmdb.put_hold(tx, m["held"], bmdb.MAINTENANCE, "rack work", "test")


#: Provider ids out of order, with a tie by value (``rack1-u02`` is ``rack1-u2``'s
#: number) and a second provider's ``rack1-u10``: what the list's rack order must sort.
RACK_NAMES = (("inv", "rack10-u1"), ("inv", "rack2-u1"), ("inv", "rack1-u10"),
              ("inv", "rack1-u2"), ("inv", "rack1-u02"), ("other", "rack1-u10"))
RACK_ORDER = ["rack1-u2", "rack1-u10", "rack2-u1", "rack10-u1"]


def seed_rack_names(session: bmdb.Session, unnamed: int) -> dict[uuid.UUID, str | None]:
    """A machine per ``RACK_NAMES`` entry and ``unnamed`` machines without a provider
    id: each machine's provider id."""
    def body(tx: bmdb.Tx) -> dict[uuid.UUID, str | None]:
        named: dict[uuid.UUID, str | None] = {}
        for provider, provider_id in RACK_NAMES:
            machine = bmdb.create_machine(tx)
            bmdb.upsert_provided(tx, machine, provider=provider, provider_id=provider_id,
                                 provider_status="Running", address="127.0.0.1")
            named[machine] = provider_id
        for _ in range(unnamed):
            named[bmdb.create_machine(tx)] = None
        return named

    return session.transact(body)


def rack_order(named: dict[uuid.UUID, str | None]) -> list[uuid.UUID]:
    """The machines in the order ``sort=name`` must list them: by rack order, ties by
    machine id, the unnamed last."""
    def place(machine: uuid.UUID) -> tuple[int, int, uuid.UUID]:
        provider_id = named[machine]
        if provider_id is None:
            return 1, 0, machine
        return 0, RACK_ORDER.index(provider_id.replace("u02", "u2")), machine

    return sorted(named, key=place)
