"""What the operator functions return beyond the BMDB's own records
(``bmdb.inspection``: machines, sessions, work, backoffs): the views composed from
several reads (a machine's detail, an explanation), ``jsonable`` for ``--json``, and
the few phrases (a hold, a machine gone from its provider) that the CLI and the web
view must word alike.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from dataclasses import dataclass, field
from typing import Any

import bmdb
from bmdb.holds import MAINTENANCE, Hold
from bmdb.inspection import BackoffInfo, WorkInfo
from bmdb.refusals import Refusal
from shepherd.workflows.guard import PAUSED_PREFIX

#: The command that lifts each kind of hold (``MACHINE`` is replaced by the id).
LIFT_COMMAND = {"maintenance": "shepherd maintenance off MACHINE",
                "quarantine": "shepherd quarantine clear MACHINE"}


def jsonable(value: Any) -> Any:
    """Plain JSON types from what the operator functions return (ids and times as
    strings)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, bytes):
        return value.hex()
    return value


def iso(value: dt.datetime) -> str:
    """A time as explanations write it (seconds, with the UTC offset)."""
    return value.isoformat(timespec="seconds")


def hold_text(hold: Hold) -> str:
    """A hold as operators read it: "in maintenance since ..., because ... (by ...)"."""
    state = "in maintenance" if hold.kind == MAINTENANCE else "quarantined"
    return f"{state} since {iso(hold.since)}, because {hold.reason} (by {hold.actor})"


def lift_command(hold: Hold) -> str:
    return LIFT_COMMAND[hold.kind].replace("MACHINE", str(hold.machine_id))


def status_text(status: str | None, provider: str | None) -> str:
    """A provider status for people: ``Missing`` means the provider stopped listing the
    machine, which Shepherd leaves alone rather than deleting."""
    if status == bmdb.ProviderStatus.MISSING.value:
        return f"gone (no longer listed by {provider})"
    return status or "—"


def refusal_text(refusal: Refusal) -> str:
    return (f"reconcile of {refusal.provider} REFUSING since {iso(refusal.since)} "
            f"(last checked {iso(refusal.checked_at)}): {refusal.cause}")


@dataclass(frozen=True)
class MachineDetail:
    now: dt.datetime
    id: uuid.UUID
    created_at: dt.datetime
    tags: dict[str, dict[str, Any]]
    work: list[WorkInfo]
    backoffs: list[BackoffInfo]
    history: list[dict[str, Any]]
    #: Maintenance and quarantine, oldest first.
    holds: list[Hold] = field(default_factory=list)
    #: The host key recorded at the first takeover (an inventory pin is not here).
    host_key: str | None = None
    host_key_fingerprint: str | None = None


@dataclass(frozen=True)
class ProcessExplanation:
    """Why a machine is or is not claimable for one process right now.

    ``paused`` and ``guard`` (the figures behind it) come from the guard's
    ``GuardDecision`` for Recovery; empty for processes the guard does not cover.
    """

    process: str
    in_backlog: bool
    backlog: str
    work: WorkInfo | None
    backoff: BackoffInfo | None
    paused: str | None = None
    guard: dict[str, Any] = field(default_factory=dict)

    @property
    def backing_off(self) -> bool:
        return self.backoff is not None and self.backoff.active

    @property
    def claimable(self) -> bool:
        """Whether a claim would take the machine now. A paused guard counts: every
        Recovery claim (sourcing, a manual task, ``shepherd start``) asks it first."""
        return (self.in_backlog and self.work is None and not self.backing_off
                and not self.paused)

    @property
    def state(self) -> str:
        """A word or two for narrow places (the web view's table)."""
        if not self.in_backlog:
            return "not in backlog"
        if self.work is not None:
            return "held by work"
        if self.backing_off:
            return "in backoff"
        return "PAUSED by the guard" if self.paused else "claimable now"

    @property
    def summary(self) -> str:
        """One line: claimable now, or the first reason it is not."""
        if not self.in_backlog:
            return f"not in backlog: {self.backlog}"
        if self.work is not None:
            state = "alive" if self.work.session_alive else "dead, the sweep releases it"
            return (f"in backlog but held by {self.work.process} work {self.work.id} "
                    f"(session {self.work.session_id}, {state})")
        if self.backing_off:
            assert self.backoff is not None
            return (f"in backlog but in backoff until {iso(self.backoff.until)} "
                    f"after: {self.backoff.cause}")
        if self.paused:
            name = self.process.removeprefix("Shepherd")
            return (f"in the backlog, but {name} is PAUSED by the guard: "
                    f"{self.paused.removeprefix(PAUSED_PREFIX)}")
        return "claimable now"

    @property
    def verdict(self) -> str:
        """The headline ``explain`` prints for the process."""
        if self.claimable:
            return "CLAIMABLE NOW"
        if self.in_backlog and self.work is None and not self.backing_off:
            return f"not claimable: {self.summary}"
        return f"not claimable ({self.state})"


@dataclass(frozen=True)
class Explanation:
    now: dt.datetime
    id: uuid.UUID
    tags: list[str]
    processes: list[ProcessExplanation]
    #: Maintenance and quarantine: why the machine is in no backlog at all.
    holds: list[Hold] = field(default_factory=list)
