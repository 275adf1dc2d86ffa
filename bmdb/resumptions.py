"""Resumptions: when agents' heartbeats could last have resumed fleet-wide, and why.

Why: while the callback server is down (or cut off from the agents), every agent
looks silent; when it comes back, the agents come back one by one over their
retry backoff, and the last of them still look silent for a moment. Recovery
restarting those would be a restart for nothing. So a callback server records a
resumption with the first heartbeats it accepts, and with the first after a pause
(``shepherd.server.resumption``), and the Recovery backlog counts **no machine
silent within one heartbeat timeout of the last resumption** (``backlog.
not_resuming``, enforced in the one query every claim and every count of silent
machines reads). The grace is bounded by that timeout: a machine still silent
after it is silent as before.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import sqlalchemy as sa

from bmdb import _schema as schema
from bmdb import tags
from bmdb._database import Tx

#: The name of the heartbeats' resumption (the only one so far).
HEARTBEATS = "heartbeats"
MAX_CAUSE = 200


@dataclass(frozen=True)
class Resumption:
    at: dt.datetime
    cause: str

    def grace_until(self, heartbeat_timeout: float) -> dt.datetime:
        """Until when no machine counts as silent (one heartbeat timeout after ``at``)."""
        return self.at + dt.timedelta(seconds=heartbeat_timeout)


def record(tx: Tx, cause: str) -> None:
    """Heartbeats resume now (``tx.now``), because of ``cause``. Two servers recording
    at once leave the later commit's (their clocks differ by the moment between)."""
    r = schema.resumptions
    tags.upsert(tx, r, {"name": HEARTBEATS}, {"at": tx.now, "cause": cause[:MAX_CAUSE]})


def last(tx: Tx) -> Resumption | None:
    """The last time heartbeats resumed, or None if no server ever recorded one."""
    r = schema.resumptions
    row = tx.execute(sa.select(r.c.at, r.c.cause).where(r.c.name == HEARTBEATS)).first()
    return None if row is None else Resumption(row.at, row.cause)
