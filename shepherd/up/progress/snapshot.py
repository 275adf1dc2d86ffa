"""What one screen of progress shows, read in one BMDB transaction (see the
package's docstring for why)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import bmdb
from bmdb import DeadSessions, FleetCounts, Refusal
from shepherd.operations.installation_views import progress_text
from shepherd.up.progress.wording import guard_figures, one_line, pause_text, short
from shepherd.workflows import guard
from shepherd.workflows.guard import CallbackCheck, GuardLimits

#: Failures read per process in backoff (newest first), of which this many distinct
#: causes are shown.
FAILURE_WINDOW = 50
CAUSES_SHOWN = 3
#: Installations in flight shown, the longest running first.
INSTALLS_SHOWN = 5
#: The longest one snapshot waits for the callback server's ``/healthz`` (s).
HEALTHZ_TIMEOUT = 2.0


@dataclasses.dataclass(frozen=True)
class BackoffSummary:
    """Machines sitting out ``process`` now, and the newest distinct failure causes of
    that process (newest first, one line each) among its last ``FAILURE_WINDOW``."""

    process: str
    machines: int
    causes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Everything one screen shows, read in one BMDB read transaction. Processes are
    named without their ``Shepherd`` prefix (``AgentStart``, ``Recovery``, ...)."""

    counts: FleetCounts
    #: Work items held now, per process (every process, zero included).
    in_flight: Mapping[str, int]
    #: Processes with machines in backoff now.
    backoffs: Sequence[BackoffSummary]
    refusals: Sequence[Refusal]
    #: None when Recovery may run, else why the guard pauses it, in plain words.
    guard: str | None
    #: The guard's figures behind ``guard``, one line ("2 of 20 started agents ...").
    guard_figures: str = ""
    #: Sessions past their deadline the sweep has not deleted, and the work they hold.
    dead: DeadSessions = dataclasses.field(default_factory=lambda: DeadSessions(0, 0))
    #: The longest-running installations in flight, one line each ("machine: writing
    #: 512 of 1024 MiB, 180 MB/s, 3 s left").
    installing: Sequence[str] = ()

    @property
    def all_heartbeating(self) -> bool:
        c = self.counts
        return c.machines > 0 and c.heartbeating >= c.machines


def read_snapshot(db: bmdb.BMDB, guard_limits: GuardLimits) -> Snapshot | str:
    """The fleet now, or why the BMDB could not be read now (busy, missing), in one line.

    The guard's callback-server check is an HTTP call: made first, outside the
    transaction, and bounded by ``HEALTHZ_TIMEOUT`` whatever ``guard_limits`` says.
    """
    limits = dataclasses.replace(
        guard_limits, healthz_timeout=min(guard_limits.healthz_timeout, HEALTHZ_TIMEOUT))
    callback = _check_callback(limits)
    try:
        return db.read(lambda tx: _read(tx, db.thresholds, limits, callback))
    except Exception as error:  # a busy or missing BMDB: say so, keep going
        return _unreadable(error)


def _check_callback(limits: GuardLimits) -> CallbackCheck | None:
    """``guard.check_callback``, never raising: a broken check (a CA file gone, say) is
    shown as the unhealthy callback server it makes the workers see."""
    try:
        return guard.check_callback(limits)
    except Exception as error:
        assert limits.healthz_url is not None  # check_callback asks nothing without one
        return CallbackCheck(limits.healthz_url,
                             f"callback server check failed: {type(error).__name__}")


def _read(tx: bmdb.Tx, thresholds: bmdb.Thresholds, limits: GuardLimits,
          callback: CallbackCheck | None) -> Snapshot:
    counts = bmdb.fleet_counts(tx, thresholds)
    decision = guard.decide(tx, thresholds, limits, callback)
    return Snapshot(
        counts=counts,
        in_flight={short(process): n for process, n in counts.active_work.items()},
        backoffs=[_backoff(tx, process, n)
                  for process, n in counts.active_backoffs.items() if n],
        refusals=bmdb.current_refusals(tx),
        guard=pause_text(decision.paused),
        guard_figures=guard_figures(decision),
        dead=bmdb.dead_sessions(tx),
        installing=_installing(tx),
    )


def _installing(tx: bmdb.Tx) -> list[str]:
    return [f"{str(machine)[:8]}: {progress_text(flight.progress, tx.now, flight.progress_at)}"
            for machine, flight in bmdb.installations_in_progress(tx, INSTALLS_SHOWN)]


def _backoff(tx: bmdb.Tx, process: str, machines: int) -> BackoffSummary:
    """The newest distinct causes: a thousand machines failing alike show one cause,
    not the same line three times."""
    causes: list[str] = []
    for failure in bmdb.latest_failures(tx, process, FAILURE_WINDOW):
        cause = one_line(failure.cause) or "(no cause recorded)"
        if cause not in causes:
            causes.append(cause)
        if len(causes) == CAUSES_SHOWN:
            break
    return BackoffSummary(short(process), machines, tuple(causes))


def _unreadable(error: BaseException) -> str:
    """Why a read failed, in one line: the error's type and its first words."""
    detail = one_line(str(getattr(error, "orig", None) or error), 120)
    return f"BMDB not readable now: {type(error).__name__}" + (f": {detail}" if detail else "")
