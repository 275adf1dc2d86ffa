"""Operator reads: list machines, show one, list sessions. Each runs in the caller's
transaction (``db.read``), so a page or a command shows one consistent moment."""

from __future__ import annotations

import datetime as dt
import uuid

import bmdb
from bmdb import inspection
from bmdb.inspection import MachineFilter, MachineList, SessionInfo
from shepherd.operator.arguments import UnknownMachine
from shepherd.operator.views import MachineDetail


def require_machine(tx: bmdb.Tx, machine_id: uuid.UUID) -> dt.datetime:
    """The machine's creation time; ``UnknownMachine`` if the BMDB has no such machine."""
    created = inspection.machine_created_at(tx, machine_id)
    if created is None:
        raise UnknownMachine(machine_id)
    return created


def list_machines(tx: bmdb.Tx, f: MachineFilter | None = None) -> MachineList:
    """Machines matching ``f`` (all: None; oldest first, at most ``f.limit``), with their
    tags, work and active backoffs, plus per-tag counts over the whole fleet."""
    return inspection.list_machines(tx, f or MachineFilter())


def show_machine(tx: bmdb.Tx, machine_id: uuid.UUID, history_limit: int = 100
                 ) -> MachineDetail:
    """Tags, current work with its session, every backoff (expired ones too), history
    newest first."""
    created = require_machine(tx, machine_id)
    return MachineDetail(
        now=tx.now, id=machine_id, created_at=created,
        tags=bmdb.queries.machine_tags(tx, machine_id),
        work=inspection.machine_work(tx, machine_id),
        backoffs=inspection.machine_backoffs(tx, machine_id),
        history=bmdb.queries.history(tx, machine_id, limit=history_limit),
    )


def list_sessions(tx: bmdb.Tx, include_dead: bool = True
                  ) -> tuple[dt.datetime, list[SessionInfo]]:
    """The BMDB's time and every session (dead ones stay until the sweep deletes
    them), newest first, with how much work each holds."""
    return tx.now, inspection.list_sessions(tx, include_dead)
