"""History rows that are not a work item's start or end: what a workflow observed while
it held the machine (each reboot rung), and operators' changes (holds, host keys).

Why in history: it is the one record operators read per machine (``shepherd show``,
the machine page), written in the same transaction as the change it describes.

Retention (``prune``): history older than a cutoff is deleted in short batches, and
never the last hour, which the blast-radius guard's reboot budget reads.
"""

from __future__ import annotations

import datetime as dt
import functools
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from bmdb import _schema as schema
from bmdb._database import Tx, run_transaction
from bmdb.vocabulary import HOUR

_ADD = sa.insert(schema.history)


def record(tx: Tx, machine_id: uuid.UUID, process: str, event: str, cause: str | None, *,
           work_id: uuid.UUID | None = None) -> None:
    """One history row at ``tx.now`` (with ``tx``'s session, if any)."""
    tx.execute(_ADD, {"machine_id": machine_id, "process": process, "event": event,
                      "at": tx.now, "work_id": work_id, "session_id": tx.session_id,
                      "cause": cause})


# -- retention ---------------------------------------------------------------------------

class CutoffTooRecent(ValueError):
    """A prune was asked to delete history the blast-radius guard still reads."""


def check_age(age: dt.timedelta) -> None:
    """Raise ``CutoffTooRecent`` unless history older than ``age`` may be pruned (the one
    statement of the rule, for settings, the CLI and ``prune`` alike).

    Why an hour: the blast-radius guard's hourly reboot budget
    (``fleet.recovery_starts_last_hour``) reads the last ``fleet.HOUR`` of Recovery
    ``Started`` rows and the ``Canceled`` rows of the same work items. A ``Canceled``
    row is written after its ``Started`` (a later transaction, so a later ``at``), so
    keeping all of the last hour keeps both halves of every pair the guard counts.
    """
    if age < HOUR:
        raise CutoffTooRecent(
            f"refusing to prune history younger than {HOUR} (asked: {age}): the "
            "blast-radius guard's hourly reboot budget reads the last hour of history")


@dataclass(frozen=True)
class _Window:
    """One batch's look at the next ``batch_size`` rows by id: the highest id seen, how
    many rows were seen, and how many of them were older than the cutoff."""

    last_id: int | None
    seen: int
    old: int


def prune(engine: Engine, older_than: dt.datetime, batch_size: int, *,
          max_batches: int | None = None,
          after_batch: Callable[[int], None] | None = None) -> int:
    """Delete the history rows with ``at`` before ``older_than``; how many were deleted.

    Batched so that it never holds locks for long: each batch is its own transaction
    over the next ``batch_size`` rows by primary key (deleting at most those), so a
    concurrent writer of history waits for one batch at most (SQLite's single writer),
    and on PostgreSQL only the rows being deleted are locked at all. Walks the primary
    key, not ``at`` (which has no index of its own): ids grow with time, and rows
    come in ``at`` order up to the length of one writer's transaction (``at`` is its
    start), so the walk stops at the first window with no row older than the cutoff.
    A row left behind by that (behind a full window of younger rows, written by a
    transaction that straddled the cutoff) goes once the rows before it are old
    enough too: late, never early. ``max_batches`` bounds one call (a periodic task's
    share of a worker); ``after_batch(deleted)`` is called after each batch committed
    (progress).

    **Invariant, enforced here:** the cutoff is at least ``fleet.HOUR`` before the
    database's clock (``check_age``), checked in every batch's own transaction (else
    ``CutoffTooRecent``, nothing deleted), so no row the guard's hourly budget reads is
    ever pruned. Only deletes: the history totals that metrics report (counted by
    triggers on INSERT, ``counters.py``) do not move.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, not {batch_size}")
    if older_than.tzinfo is None:
        raise ValueError(f"naive cutoff {older_than!r}; use a UTC-aware time")
    deleted, after, batches = 0, None, 0
    while max_batches is None or batches < max_batches:
        window, count = run_transaction(
            engine, functools.partial(_prune_batch, older_than, batch_size, after))
        deleted, after, batches = deleted + count, window.last_id, batches + 1
        if after_batch is not None:
            after_batch(count)
        if window.seen < batch_size or window.old == 0:
            break
    return deleted


_ID, _AT = schema.history.c.id, schema.history.c.at


def _prune_batch(cutoff: dt.datetime, size: int, after: int | None,
                 tx: Tx) -> tuple[_Window, int]:
    """One batch: refuse a cutoff inside the guard's window, look at the next ``size``
    rows after id ``after``, delete those of them older than ``cutoff``."""
    check_age(tx.now - cutoff)
    window = _look(tx, cutoff, size, after)
    if not window.old:
        return window, 0
    lowest = sa.true() if after is None else after < _ID
    deleted = tx.execute(sa.delete(schema.history).where(
        lowest, window.last_id >= _ID, cutoff > _AT)).rowcount
    return window, deleted


def _look(tx: Tx, cutoff: dt.datetime, size: int, after: int | None) -> _Window:
    """The next ``size`` rows by id: an index range scan of the primary key, whatever
    the table's size (a row committed into that id range later is younger than any
    cutoff a prune may use, so the delete by range stays within the window's rows)."""
    rows = sa.select(_ID, _AT).order_by(_ID).limit(size)
    if after is not None:
        rows = rows.where(after < _ID)
    w = rows.subquery()
    old = sa.func.coalesce(sa.func.sum(sa.case((w.c.at < cutoff, 1), else_=0)), 0)
    last_id, seen, old_rows = tx.execute(
        sa.select(sa.func.max(w.c.id), sa.func.count(), old)).one()
    return _Window(last_id, int(seen), int(old_rows))
