"""Fleet-wide server secrets, kept in the BMDB: created once, then shared by every process.

Why the BMDB: every callback server process and every worker of one fleet must use
the same key (a worker tells agents its public half at takeover, a server signs
with its private half), and the BMDB is the one thing they all reach; no shared
volume or secret distribution is needed. Whoever can read the BMDB could sign
answers, but whoever can write it controls the fleet anyway.

Bytes only: generating and using a key is the caller's (``shepherd.server.answers``).
"""

from __future__ import annotations

import functools

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from bmdb import _schema as schema
from bmdb._database import Tx


def ensure(tx: Tx, name: str, candidate: bytes) -> bytes:
    """The secret stored as ``name``; ``candidate`` is stored first if there is none.

    Invariant: one value per name, ever (the primary key; nothing here updates or
    deletes a row). Two processes racing to create it both end up with the first
    writer's value: the INSERT does nothing on a conflict (on PostgreSQL it waits
    for the other writer's commit first), and the SELECT that follows, a statement
    of its own at READ COMMITTED, reads the committed row.
    """
    k = schema.server_keys
    tx.execute(_insert(tx.dialect), {"name": name, "private_key": candidate,
                                     "created_at": tx.now})
    return bytes(tx.execute(sa.select(k.c.private_key).where(k.c.name == name)).scalar_one())


@functools.cache
def _insert(dialect: str) -> sa.Insert:
    k = schema.server_keys
    insert = (postgresql.insert if dialect == "postgresql" else sqlite.insert)(k)
    return insert.values({c: sa.bindparam(c) for c in ("name", "private_key", "created_at")}
                         ).on_conflict_do_nothing(index_elements=[k.c.name])
