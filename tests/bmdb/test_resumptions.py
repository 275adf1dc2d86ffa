"""After heartbeats resume fleet-wide, no machine counts as silent for one heartbeat
timeout (``bmdb.resumptions``): neither in Recovery's backlog nor in the guard's count.
On PostgreSQL and SQLite (the ``db`` fixture: heartbeat timeout 30 s, first 60 s)."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
import sqlalchemy as sa

import bmdb
from bmdb import Process
from tests.support.bmdb_helpers import backlog_ids, seed_provided


def silent_pair(session: bmdb.Session) -> tuple[uuid.UUID, uuid.UUID]:
    """One machine whose last heartbeat is 45 s old, one whose agent started 90 s ago
    and never heartbeated: both silent by their own timeouts."""
    quiet, never = seed_provided(session, 2)

    def body(tx: bmdb.Tx) -> None:
        s, h = bmdb._schema.agent_started, bmdb._schema.agent_heartbeat
        for machine in (quiet, never):
            bmdb.set_agent_started(tx, machine, b"\x01" * 32)
        tx.execute(sa.update(s).where(s.c.machine_id == never)
                   .values(started_at=tx.now - dt.timedelta(seconds=90)))
        bmdb.record_heartbeat(tx, quiet, tx.now)
        tx.execute(sa.update(h).where(h.c.machine_id == quiet)
                   .values(last_heartbeat_at=tx.now - dt.timedelta(seconds=45)))

    session.transact(body)
    return quiet, never


FIRST = "a callback server accepted its first heartbeats"


def resumed(session: bmdb.Session, ago: float, cause: str = FIRST) -> None:
    def body(tx: bmdb.Tx) -> None:
        bmdb.record_resumption(tx, cause)
        r = bmdb._schema.resumptions
        tx.execute(sa.update(r).values(at=tx.now - dt.timedelta(seconds=ago)))

    session.transact(body)


def silent_count(db: bmdb.BMDB) -> int:
    return db.read(lambda tx: bmdb.silent_machines(tx, db.thresholds))


def test_no_machine_is_silent_within_a_heartbeat_timeout_of_a_resumption(db, session):
    quiet, never = silent_pair(session)
    assert db.read(bmdb.last_resumption) is None
    assert backlog_ids(session, Process.RECOVERY) == {quiet, never}
    assert silent_count(db) == 2

    resumed(session, ago=29)
    assert backlog_ids(session, Process.RECOVERY) == set()
    assert silent_count(db) == 0
    last = db.read(bmdb.last_resumption)
    assert last is not None and last.cause == FIRST
    assert last.grace_until(db.thresholds.heartbeat) == last.at + dt.timedelta(seconds=30)
    # Nor can a claim by name take one: it reads the same query.
    with pytest.raises(bmdb.NotInBacklog):
        session.claim_machine(Process.RECOVERY, quiet)

    resumed(session, ago=31, cause="heartbeats accepted again after none for 20s")
    assert backlog_ids(session, Process.RECOVERY) == {quiet, never}
    assert silent_count(db) == 2
    assert db.read(bmdb.last_resumption).cause.startswith("heartbeats accepted again")


def test_a_resumption_moves_to_the_latest_and_keeps_one_row(db, session):
    resumed(session, ago=100, cause="first")
    session.transact(lambda tx: bmdb.record_resumption(tx, "second " + "x" * 300))
    last = db.read(bmdb.last_resumption)
    assert last is not None and last.cause == ("second " + "x" * 300)[:200]
    assert db.read(lambda tx: tx.execute(
        sa.select(sa.func.count()).select_from(bmdb._schema.resumptions)).scalar_one()) == 1
    assert db.read(lambda tx: tx.now) - last.at < dt.timedelta(seconds=10)
