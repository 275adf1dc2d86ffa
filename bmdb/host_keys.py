"""Pinned SSH host keys, trust on first use.

A machine's host key is recorded at its first successful takeover and required at
every later one (``shepherd.remote`` compares before anything is uploaded). Only an
operator resets it (``shepherd host-key forget``), after a reinstall gave the
machine a new key. A pin from the inventory file wins and is never stored here.
"""

from __future__ import annotations

import uuid

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from bmdb import _schema as schema
from bmdb import history
from bmdb._database import Tx
from bmdb.vocabulary import Event, Topic


def pinned(tx: Tx, machine_id: uuid.UUID) -> str | None:
    """The recorded host key (an OpenSSH public-key line), or None."""
    k = schema.host_keys
    return tx.execute(sa.select(k.c.host_key).where(k.c.machine_id == machine_id)
                      ).scalar_one_or_none()


def pin(tx: Tx, machine_id: uuid.UUID, host_key: str, fingerprint: str) -> bool:
    """Record ``host_key`` unless one is recorded already (the first use wins);
    True if this call recorded it."""
    k = schema.host_keys
    insert = (postgresql.insert if tx.dialect == "postgresql" else sqlite.insert)(k)
    added = tx.execute(insert.values(machine_id=machine_id, host_key=host_key,
                                     recorded_at=tx.now).on_conflict_do_nothing())
    if added.rowcount != 1:
        return False
    history.record(tx, machine_id, Topic.HOST_KEY, Event.PINNED,
                   f"trusted on first use: {fingerprint}")
    return True


def forget(tx: Tx, machine_id: uuid.UUID, actor: str) -> bool:
    """Drop the recorded host key (the next takeover pins a new one); False if none."""
    k = schema.host_keys
    deleted = tx.execute(sa.delete(k).where(k.c.machine_id == machine_id))
    if deleted.rowcount != 1:
        return False
    history.record(tx, machine_id, Topic.HOST_KEY, Event.FORGOTTEN, f"by {actor}")
    return True
