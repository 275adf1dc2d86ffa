"""History rows that are not a work item's start or end: what a workflow observed while
it held the machine (each reboot rung), and operators' changes (holds, host keys).

Why in history: it is the one record operators read per machine (``shepherd show``,
the machine page), written in the same transaction as the change it describes.
"""

from __future__ import annotations

import uuid

import sqlalchemy as sa

from bmdb import schema
from bmdb.database import Tx

#: Events beyond a work item's own (``bmdb.work.Event``); at most 16 characters.
RUNG = "Rung"
HELD = "Held"
RELEASED = "Released"
PINNED = "Pinned"
FORGOTTEN = "Forgotten"

#: The ``process`` column of rows that no work item wrote.
MAINTENANCE = "Maintenance"
QUARANTINE = "Quarantine"
HOST_KEY = "HostKey"

_ADD = sa.insert(schema.history)


def record(tx: Tx, machine_id: uuid.UUID, process: str, event: str, cause: str | None, *,
           work_id: uuid.UUID | None = None) -> None:
    """One history row at ``tx.now`` (with ``tx``'s session, if any)."""
    tx.execute(_ADD, {"machine_id": machine_id, "process": process, "event": event,
                      "at": tx.now, "work_id": work_id, "session_id": tx.session_id,
                      "cause": cause})
