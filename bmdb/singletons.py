"""Fleet-wide singletons: at most one holder of a name at a time, across every host.

Used for work that must not run twice at once whatever starts it (reconcile from
two beats, or from a beat and an operator). A hold belongs to a session: it ends
when released, or when the session dies (taken over at once by the next claimant,
and deleted with the session by the sweep). Enforced by the primary key on
``singletons.name``; the take-over condition sits in the upsert's WHERE clause,
so two claimants racing for a dead holder's name cannot both win.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from bmdb import _schema as schema
from bmdb._database import Tx

if TYPE_CHECKING:
    from bmdb.sessions import Session


def try_acquire(tx: Tx, name: str) -> bool:
    """Take ``name`` for ``tx``'s session if it is free or its holder's session is dead."""
    s, t = schema.sessions, schema.singletons
    insert = (postgresql.insert if tx.dialect == "postgresql" else sqlite.insert)(t)
    # The subquery names only ``sessions``: an EXISTS naming ``singletons`` too is not
    # correlated inside ON CONFLICT (SQLAlchemy renders "FROM sessions, singletons"),
    # and over the statement's snapshot, where a racing claimant's row is not there
    # yet, every claimant would win.
    alive = sa.select(s.c.id).where(s.c.deadline > tx.now)
    holder_dead = t.c.session_id.not_in(alive)
    tx.execute(
        insert.values(name=name, session_id=tx.session_id, acquired_at=tx.now)
        .on_conflict_do_update(
            index_elements=[t.c.name],
            set_={"session_id": tx.session_id, "acquired_at": tx.now},
            where=holder_dead,
        )
    )
    holder: uuid.UUID = tx.execute(sa.select(t.c.session_id).where(t.c.name == name)).scalar_one()
    return holder == tx.session_id


def release(tx: Tx, name: str) -> None:
    t = schema.singletons
    tx.execute(sa.delete(t).where(t.c.name == name, t.c.session_id == tx.session_id))


@contextlib.contextmanager
def hold(session: Session, name: str, *, wait: float = 0.0,
         poll: float = 0.2) -> Iterator[bool]:
    """``with hold(session, "reconcile") as held:`` — ``held`` is False if another holds it
    (still, after asking again every ``poll`` seconds for up to ``wait`` seconds)."""
    deadline = time.monotonic() + wait
    held = session.transact(lambda tx: try_acquire(tx, name))
    while not held and time.monotonic() < deadline:
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))
        held = session.transact(lambda tx: try_acquire(tx, name))
    try:
        yield held
    finally:
        if held:
            session.transact(lambda tx: release(tx, name))
