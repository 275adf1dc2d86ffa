"""The errors the BMDB raises, so callers can tell a lost lease from a lost race."""

from __future__ import annotations

import uuid


class BMDBError(Exception):
    """Base of every error this package raises on purpose."""


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
