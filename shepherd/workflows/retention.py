"""History retention: delete history older than the configured age, in short batches.

Why: every work item writes history (its start and end, each reboot rung, holds), so
without a bound the table, and every read of it, grows with the fleet's whole past.
The rule of what may go (never the last hour, which the blast-radius guard's hourly
reboot budget reads) is the BMDB's own (``bmdb.BMDB.prune_history``); this module only
turns an age into a cutoff on the database's clock, and bounds a periodic run.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import bmdb

#: Rows per transaction: a batch is a few milliseconds, so writers never wait long.
BATCH_SIZE = 1000
#: Batches per periodic run (100k rows): a run is a few seconds of one control worker,
#: so sourcing and the sweep are not held up behind a first prune of years of history;
#: the next run goes on where this one stopped. ``shepherd history prune`` has no bound.
MAX_BATCHES_PER_RUN = 100


@dataclass(frozen=True)
class RetentionSettings:
    #: How old history must be to go; None keeps it forever.
    keep: dt.timedelta | None
    batch_size: int = BATCH_SIZE
    #: None: until nothing older than the cutoff is left.
    max_batches: int | None = MAX_BATCHES_PER_RUN


@dataclass(frozen=True)
class PruneResult:
    """What a prune did (a task's result, the CLI's output)."""

    deleted: int
    #: Rows with ``at`` before this went; None when history is kept forever.
    cutoff: dt.datetime | None
    #: The run used all its ``max_batches``: older rows may remain for the next run.
    capped: bool = False

    def to_json(self) -> dict[str, Any]:
        cutoff = self.cutoff.isoformat() if self.cutoff is not None else None
        return {"deleted": self.deleted, "cutoff": cutoff, "capped": self.capped}


def prune(db: bmdb.BMDB, settings: RetentionSettings,
          after_batch: Callable[[int], None] | None = None) -> PruneResult:
    """Delete history older than ``settings.keep`` before the database's clock.

    Raises ``bmdb.CutoffTooRecent`` (a ``ValueError``) for an age under an hour.
    Why the database's clock: the rows' ``at`` and the guard's window are on it, so a
    host whose own clock is off can neither prune the guard's hour nor be refused.
    """
    if settings.keep is None:
        return PruneResult(deleted=0, cutoff=None)
    bmdb.check_prune_age(settings.keep)
    cutoff = db.read(lambda tx: tx.now) - settings.keep
    batches: list[int] = []

    def counted(deleted: int) -> None:
        batches.append(deleted)
        if after_batch is not None:
            after_batch(deleted)

    deleted = db.prune_history(cutoff, settings.batch_size,
                               max_batches=settings.max_batches, after_batch=counted)
    return PruneResult(deleted=deleted, cutoff=cutoff,
                       capped=len(batches) == settings.max_batches)
