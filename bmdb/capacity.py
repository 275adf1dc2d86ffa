"""Capacity: cooldowns for capacity that failed to provision, and creation intents.

Kept in the BMDB rather than in a worker's memory because provisioning runs in
whichever worker process picks up the reconcile task: the memory must be shared,
and must outlive a worker killed in the middle of a creation.
"""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa

from bmdb import _schema as schema
from bmdb._database import Tx
from bmdb.tags import upsert


def cool_down(tx: Tx, provider: str, capacity_id: str, seconds: float, cause: str) -> None:
    upsert(
        tx,
        schema.capacity_cooldown,
        {"provider": provider, "capacity_id": capacity_id},
        {"until": tx.now + dt.timedelta(seconds=seconds), "cause": cause},
    )


def cooling(tx: Tx, provider: str) -> dict[str, str]:
    """capacity id -> cause, for the provider's capacity still sitting out."""
    c = schema.capacity_cooldown
    rows = tx.execute(
        sa.select(c.c.capacity_id, c.c.cause).where(c.c.provider == provider, c.c.until > tx.now)
    )
    return {row.capacity_id: row.cause for row in rows}


# -- creation intents (see ``schema.creation_intents``) ----------------------------

#: How long an intent whose device never showed up is kept (the creation failed).
INTENT_LIFETIME = dt.timedelta(days=1)


def record_intent(tx: Tx, provider: str, capacity_id: str, witness: str) -> None:
    """Say, before asking the provider, that a machine is being created under ``witness``."""
    tx.execute(sa.insert(schema.creation_intents).values(
        provider=provider, witness=witness, capacity_id=capacity_id, created_at=tx.now))


def forget_intent(tx: Tx, provider: str, witness: str) -> None:
    """The creation is registered (or definitely failed): nothing left to recognise."""
    i = schema.creation_intents
    tx.execute(sa.delete(i).where(i.c.provider == provider, i.c.witness == witness))


def pending_intents(tx: Tx, provider: str) -> dict[str, str]:
    """witness -> capacity id, for the provider's creations not registered yet; intents
    older than ``INTENT_LIFETIME`` are dropped first (their creation never landed)."""
    i = schema.creation_intents
    tx.execute(sa.delete(i).where(i.c.provider == provider,
                                  i.c.created_at < tx.now - INTENT_LIFETIME))
    rows = tx.execute(sa.select(i.c.witness, i.c.capacity_id).where(i.c.provider == provider))
    return {row.witness: row.capacity_id for row in rows}
