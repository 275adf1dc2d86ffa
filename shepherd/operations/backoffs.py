"""The operator's override: clear a machine's backoff so the next claim may take it."""

from __future__ import annotations

import uuid

import bmdb
from bmdb import BackoffInfo
from shepherd.operations.reads import require_machine


def clear_backoff(session: bmdb.Session, machine_id: uuid.UUID, process: bmdb.Process
                  ) -> BackoffInfo | None:
    """Delete the machine's backoff for ``process``; returns what was deleted, None if
    there was none (``UnknownMachine`` for no such machine). Records nothing else: the
    next claim's ``Started`` history is the trace that matters."""

    def body(tx: bmdb.Tx) -> BackoffInfo | None:
        require_machine(tx, machine_id)
        found = bmdb.machine_backoffs(tx, machine_id, process)
        bmdb.clear_backoff(tx, machine_id, process)
        return found[0] if found else None

    return session.transact(body)
