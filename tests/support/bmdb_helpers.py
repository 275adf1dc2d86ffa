"""Small helpers for BMDB tests: seeding machines and reading history."""

from __future__ import annotations

import uuid

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
