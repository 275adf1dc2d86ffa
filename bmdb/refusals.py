"""Reconcile refusals: a provider whose last reconcile refused to act, and why.

Why in the BMDB: the refusal happens in a worker, but the operator looks at
``shepherd fleet``, the web view, ``shepherd up``'s progress line and the metrics.
Recorded on every refusing run (``since`` kept from the first), cleared by the
first run that goes through.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import sqlalchemy as sa

from bmdb import _schema as schema
from bmdb import tags
from bmdb._database import Tx


@dataclass(frozen=True)
class Refusal:
    provider: str
    cause: str
    since: dt.datetime
    checked_at: dt.datetime


def record(tx: Tx, provider: str, cause: str) -> None:
    r = schema.reconcile_refusals
    since = tx.execute(sa.select(r.c.since).where(r.c.provider == provider)).scalar_one_or_none()
    tags.upsert(tx, r, {"provider": provider},
                {"cause": cause[:2000], "since": since or tx.now, "checked_at": tx.now})


def clear(tx: Tx, provider: str) -> None:
    r = schema.reconcile_refusals
    tx.execute(sa.delete(r).where(r.c.provider == provider))


def current(tx: Tx) -> list[Refusal]:
    """Every provider's standing refusal, by provider name."""
    r = schema.reconcile_refusals
    rows = tx.execute(sa.select(r).order_by(r.c.provider))
    return [Refusal(row.provider, row.cause, row.since, row.checked_at) for row in rows]
