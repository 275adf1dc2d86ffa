"""The sweep: nothing stays locked.

Releases work held by sessions whose deadline passed (``Abandoned`` history
naming the dead session), releases claims that were never adopted within their
dispatch deadline (``Canceled``), deletes the dead sessions, and folds the counters'
shards (``counters.compact``). Run it
periodically from any one component; running it from several at once is safe.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from bmdb import _counters as counters
from bmdb import _schema as schema
from bmdb._database import Tx, run_transaction
from bmdb.vocabulary import Event


@dataclass(frozen=True)
class SweepResult:
    abandoned: int
    unadopted: int
    sessions_deleted: int


def sweep(engine: Engine) -> SweepResult:
    return run_transaction(engine, _sweep)


def _sweep(tx: Tx) -> SweepResult:
    s, w = schema.sessions, schema.work
    dead = _lock_dead_sessions(tx)
    abandoned = _release(
        tx, w.c.session_id.in_(dead), Event.ABANDONED,
        cause=lambda row: f"session {row.session_id} expired",
    ) if dead else 0
    unadopted = _release(
        tx, w.c.dispatch_deadline <= tx.now, Event.CANCELED,
        cause=lambda row: "claim not adopted before its dispatch deadline",
    )
    deleted = tx.execute(
        sa.delete(s).where(s.c.id.in_(dead), ~sa.exists().where(w.c.session_id == s.c.id))
    ).rowcount if dead else 0
    counters.compact(tx)
    return SweepResult(abandoned=abandoned, unadopted=unadopted, sessions_deleted=deleted)


def _lock_dead_sessions(tx: Tx) -> list[uuid.UUID]:
    """Dead sessions that no transaction is using right now, locked until the sweep commits.

    A session's transaction holds a key-share lock on its row from its liveness
    check to its commit (``sessions.py``), and so does a new work row's foreign
    key. A transaction that checked in just before the deadline may still be
    committing a claim: FOR UPDATE conflicts with its lock, so SKIP LOCKED passes
    that session over until the next sweep, instead of deleting it from under
    the new work row (a foreign-key error that would undo the whole sweep). Once
    locked here, no new work can point at these sessions.
    """
    s = schema.sessions
    return list(tx.execute(
        sa.select(s.c.id).where(s.c.deadline <= tx.now).with_for_update(skip_locked=True)
    ).scalars())


def _release(tx: Tx, condition: sa.ColumnElement[bool], event: str,
             cause: Callable[[sa.Row[Any]], str]) -> int:
    w = schema.work
    rows = tx.execute(
        sa.delete(w).where(condition).returning(w.c.id, w.c.machine_id, w.c.process, w.c.session_id)
    ).all()
    if rows:
        tx.execute(
            sa.insert(schema.history),
            [
                {
                    "machine_id": row.machine_id,
                    "process": row.process,
                    "event": event,
                    "at": tx.now,
                    "work_id": row.id,
                    "session_id": row.session_id,
                    "cause": cause(row),
                }
                for row in rows
            ],
        )
    return len(rows)
