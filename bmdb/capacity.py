"""Capacity cooldowns: free capacity that failed to provision sits out for a while.

Kept in the BMDB rather than in a worker's memory because provisioning runs in
whichever worker process picks up the reconcile task: the memory must be shared.
"""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa

from bmdb import schema
from bmdb.database import Tx
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
