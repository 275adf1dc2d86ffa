"""Pinned SSH host keys: trusted on first use, or chosen by an installation.

A machine's host key is recorded at its first successful takeover and required at
every later one (``shepherd.remote`` compares before anything is uploaded). Only an
operator resets it (``shepherd host-key forget``), after a reinstall behind Shepherd's
back gave the machine a new key, or accepts the key a takeover met (``pin_accepted``).
A pin from the inventory file wins over a first use's and is never stored here.

An installation pins the key it chose (``pin_installed``) before the system it wrote
first boots, replacing whatever was recorded: no trust on first sight for a system
Shepherd installed. That pin wins over the inventory's too, whose key names the system
the machine had before, and so does an operator's acceptance (``RecordedPin.chosen``;
``shepherd.workflows.initializer`` applies the order).
"""

from __future__ import annotations

import uuid
from typing import NamedTuple

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from bmdb import _schema as schema
from bmdb import history, holds
from bmdb._database import Tx
from bmdb.tags import upsert
from bmdb.vocabulary import HOST_KEY_HOLD, Event, Topic

FIRST_USE = "first_use"
INSTALLATION = "installation"
#: An operator accepted the key a takeover met (``shepherd host-key accept``).
OPERATOR = "operator"


class RecordedPin(NamedTuple):
    """A recorded host key and where it comes from."""

    host_key: str
    source: str
    generation: int | None

    @property
    def chosen(self) -> bool:
        """Shepherd chose this key for a system it installed, or an operator accepted it
        after a takeover met it: either wins over the inventory's, which is older."""
        return self.source in (INSTALLATION, OPERATOR)


def pinned(tx: Tx, machine_id: uuid.UUID) -> str | None:
    """The recorded host key (an OpenSSH public-key line), or None."""
    k = schema.host_keys
    return tx.execute(sa.select(k.c.host_key).where(k.c.machine_id == machine_id)
                      ).scalar_one_or_none()


def recorded(tx: Tx, machine_id: uuid.UUID) -> RecordedPin | None:
    """The recorded pin with its source, or None."""
    k = schema.host_keys
    row = tx.execute(sa.select(k.c.host_key, k.c.source, k.c.generation)
                     .where(k.c.machine_id == machine_id)).one_or_none()
    return None if row is None else RecordedPin(row.host_key, row.source, row.generation)


def pin_installed(tx: Tx, machine_id: uuid.UUID, host_key: str, fingerprint: str,
                  generation: int) -> None:
    """Pin the key installation ``generation`` chose, replacing any recorded pin; a
    host-key hold goes with the pin it was held against."""
    upsert(tx, schema.host_keys, {"machine_id": machine_id},
           {"host_key": host_key, "recorded_at": tx.now, "source": INSTALLATION,
            "generation": generation})
    history.record(tx, machine_id, Topic.HOST_KEY, Event.PINNED,
                   f"chosen by installation generation {generation}: {fingerprint}")
    holds.lift(tx, machine_id, HOST_KEY_HOLD, f"installation generation {generation}",
               "it pinned a key of its own")


def pin_accepted(tx: Tx, machine_id: uuid.UUID, host_key: str, fingerprint: str,
                 actor: str) -> None:
    """Pin the key an operator accepted, replacing any recorded pin."""
    upsert(tx, schema.host_keys, {"machine_id": machine_id},
           {"host_key": host_key, "recorded_at": tx.now, "source": OPERATOR,
            "generation": None})
    history.record(tx, machine_id, Topic.HOST_KEY, Event.PINNED,
                   f"accepted by {actor.strip()[:128]}: {fingerprint}")


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
