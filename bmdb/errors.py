"""The errors the BMDB raises, so callers can tell a lost lease from a lost race, and
need none of SQLAlchemy's to tell that the database is out of reach."""

from __future__ import annotations

import uuid


class BMDBError(Exception):
    """Base of every error this package raises on purpose."""


class Unavailable(BMDBError):
    """The BMDB cannot be used now: it does not answer, the connection dropped, no
    connection came free in time, or its schema is not (yet) migrated. Raised at the
    package's boundary (every transaction, ``ping``, migrations) from SQLAlchemy's
    errors, after the transient ones were retried; the text is the driver's first line.
    """


class CommitOutcomeUnknown(Unavailable):
    """The connection dropped during COMMIT: the transaction may or may not have landed.

    Never retried blindly (a claim could land twice). Sessions end on it, so that
    whatever the lost commit did is released by the sweep.
    """


class BadURL(BMDBError, ValueError):
    """A text that is not a database URL."""


class UnknownDialect(BadURL):
    """A database URL whose dialect (``postgresql``, ``sqlite``, ...) nobody provides."""


class DriverMissing(BadURL):
    """A database URL whose driver (``psycopg2``, ...) is not installed."""


class SessionExpired(BMDBError):
    """The session's deadline passed (or its row was swept): every transaction refuses to run.

    The owner must start a new session; work held by the old one is released by the sweep.
    """


class WorkGone(BMDBError):
    """The work item no longer belongs to the caller: released, swept, adopted or finished."""


class NotClaimable(BMDBError):
    """A claim for one named machine found nothing to claim; the subclass says why."""

    def __init__(self, machine_id: uuid.UUID, process: str, reason: str) -> None:
        super().__init__(f"machine {machine_id} cannot start {process}: {reason}")
        self.machine_id = machine_id
        self.process = process
        self.reason = reason


class MachineBusy(NotClaimable):
    """Another work item of the same exclusion group holds the machine."""


class MachineInBackoff(NotClaimable):
    """The machine failed this process recently and waits out its backoff."""


class NotInBacklog(NotClaimable):
    """The machine does not need this process now (or does not exist)."""
