"""``explain``: why a machine is or is not claimable, in words an operator can act on.

Why it reads the tags *and* runs the backlog query: the query is the truth (what a
claim would see), the tags say why. For Recovery it asks the guard the way every
claimer does (``guard.decide``, inside this same read transaction, with the callback
server checked before it), so "claimable" here is exactly what a claim would take.
All of it comes from one transaction, on the BMDB's clock.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass
from typing import Any

import bmdb
from shepherd.operations.arguments import BACKLOG_PROCESSES
from shepherd.operations.installation_views import install_reason
from shepherd.operations.reads import require_machine
from shepherd.operations.views import (
    Explanation,
    ProcessExplanation,
    hold_text,
    iso,
    lift_command,
    status_text,
)
from shepherd.workflows import guard
from shepherd.workflows.guard import CallbackCheck, GuardDecision, GuardLimits


def explain_machine(db: bmdb.BMDB, machine_id: uuid.UUID, limits: GuardLimits
                    ) -> Explanation:
    """``explain`` with the whole guard a claimer asks: the callback server checked first
    (when ``limits`` names it), outside the transaction, then one read transaction."""
    callback = guard.check_callback(limits)
    return db.read(lambda tx: explain(tx, machine_id, db.thresholds, limits, callback))


def explain(tx: bmdb.Tx, machine_id: uuid.UUID, thresholds: bmdb.Thresholds,
            limits: GuardLimits | None = None, callback: CallbackCheck | None = None
            ) -> Explanation:
    """For AgentStart and Recovery: in the backlog or not and why, the work holding the
    machine in the group (and whether its session lives), the active backoff, and for
    Recovery what the blast-radius guard decides (share of silent agents, hourly budget,
    and the callback server's health as ``guard.check_callback`` found it: not checked
    when ``callback`` is None; ``explain_machine`` checks it)."""
    require_machine(tx, machine_id)
    known = MachineFacts.read(tx, machine_id)
    decision = guard.decide(tx, thresholds, limits or GuardLimits(), callback)
    out = [explain_process(tx, process, machine_id, thresholds, known,
                           decision if process is bmdb.Process.RECOVERY else None)
           for process in BACKLOG_PROCESSES]
    return Explanation(now=tx.now, id=machine_id, tags=list(known.tags), processes=out,
                       holds=known.holds)


@dataclass(frozen=True)
class MachineFacts:
    """What each process's explanation reads of the machine, read once for all of them
    (a machine page explains every process: a statement per process and fact was half
    its round trips)."""

    #: As stored: no document is decoded, so none that is undecodable can fail this.
    tags: dict[str, dict[str, Any]]
    holds: list[bmdb.Hold]
    #: Every process's, oldest first; and every backoff, expired ones too.
    work: list[bmdb.WorkInfo]
    backoffs: list[bmdb.BackoffInfo]
    installation: bmdb.Installation

    @classmethod
    def read(cls, tx: bmdb.Tx, machine_id: uuid.UUID) -> MachineFacts:
        return cls(bmdb.machine_tags_as_stored(tx, machine_id), bmdb.holds_of(tx, machine_id),
                   bmdb.machine_work(tx, machine_id), bmdb.machine_backoffs(tx, machine_id),
                   bmdb.installation_of(tx, machine_id))


def explain_process(tx: bmdb.Tx, process: bmdb.Process, machine_id: uuid.UUID,
                    thresholds: bmdb.Thresholds, known: MachineFacts,
                    decision: GuardDecision | None = None) -> ProcessExplanation:
    """One process of ``explain``; ``decision`` is the guard's, for a guarded process.
    A hold (maintenance, quarantine) is the reason before any other: the backlog
    queries leave held machines out whatever their tags say."""
    group = bmdb.exclusion_group(process)
    held = [w for w in known.work if w.exclusion_group == group]
    backoffs = [b for b in known.backoffs if b.process == process.value]
    tags = known.tags
    if known.holds:
        reason = held_reason(known.holds)
    elif process is bmdb.Process.AGENT_START:
        reason = _agent_start_reason(tags)
    elif process is bmdb.Process.OS_INSTALL:
        heartbeat = tags.get("AgentHeartbeat")
        reason = install_reason(known.installation, tx.now,
                                heartbeat["last_heartbeat_at"] if heartbeat else None,
                                thresholds)
    else:
        reason = (_installing_reason(known.installation)
                  or _recovery_reason(tags, tx.now, thresholds, bmdb.last_resumption(tx)))
    return ProcessExplanation(
        process=process.value,
        in_backlog=bmdb.in_backlog(tx, process, machine_id, thresholds),
        backlog=reason, work=held[0] if held else None,
        backoff=backoffs[0] if backoffs else None,
        paused=decision.paused if decision else None,
        guard=guard_figures(decision) if decision else {},
    )


def guard_figures(decision: GuardDecision) -> dict[str, Any]:
    """The numbers behind the guard's decision, as ``explain`` shows them."""
    return {"started": decision.started, "silent": decision.silent,
            "max_share": decision.max_share, "min_silent": decision.min_silent,
            "reboots_last_hour": decision.reboots_last_hour,
            "reboots_per_hour": decision.reboots_per_hour,
            "callback_server": decision.callback_url,
            "callback_healthy": decision.callback_healthy}


def why_not(db: bmdb.BMDB, process: bmdb.Process, machine_id: uuid.UUID) -> bmdb.NotClaimable:
    """The reason a claim of ``machine_id`` for ``process`` found nothing, as the BMDB's
    own error types, in ``explain``'s words (which say *why* a machine is not in its
    backlog, where the BMDB's own reason only says that it is not)."""

    def read(tx: bmdb.Tx) -> ProcessExplanation:
        require_machine(tx, machine_id)
        return explain_process(tx, process, machine_id, db.thresholds,
                               MachineFacts.read(tx, machine_id))

    mine = db.read(read)
    if mine.in_backlog and mine.work is not None:
        return bmdb.MachineBusy(machine_id, process.value, mine.summary.removeprefix(
            "in backlog but "))
    if mine.in_backlog and mine.backing_off:
        return bmdb.MachineInBackoff(machine_id, process.value, mine.summary.removeprefix(
            "in backlog but "))
    if mine.in_backlog:  # became claimable meanwhile: a race, not a reason
        return bmdb.NotClaimable(machine_id, process.value, "its state changed during the "
                                 "claim; try again")
    return bmdb.NotInBacklog(machine_id, process.value, mine.summary)


# -- the wording -----------------------------------------------------------------------


def held_reason(holds: list[bmdb.Hold]) -> str:
    """Why a held machine is in no backlog, and the command that lets it back."""
    return "; ".join(f"{hold_text(h)}: held machines are in no backlog "
                     f"(`{lift_command(h)}` lets it back)" for h in holds)


def _gone_reason(provided: dict[str, Any] | None) -> str | None:
    """Why a machine its provider no longer lists is in no backlog, or None."""
    if provided is None or provided["provider_status"] != bmdb.ProviderStatus.MISSING.value:
        return None
    return (f"{status_text(provided['provider_status'], provided['provider'])} since "
            f"{iso(provided['updated_at'])}, as {provided['provider_id']}: Shepherd "
            "leaves it alone and never deletes it")


def _agent_start_reason(tags: dict[str, dict[str, Any]]) -> str:
    provided = tags.get("Provided")
    if provided is None:
        return "no Provided tag: no provider has reported this machine"
    at = f"{provided['provider']} {provided['provider_id']}"
    gone = _gone_reason(provided)
    if gone:
        return gone
    if provided["provider_status"] != bmdb.ProviderStatus.RUNNING.value:
        return (f"provider status is {provided['provider_status']}, not Running "
                f"({at}, updated {iso(provided['updated_at'])})")
    started = tags.get("AgentStarted")
    if started is not None:
        return f"has AgentStarted: agent started at {iso(started['started_at'])}"
    return f"Running at the provider ({at}) and no agent started yet"


def _installing_reason(installation: bmdb.Installation) -> str | None:
    """Why Recovery leaves a machine alone while an installation boots it, or None."""
    wanted = installation.wanted
    if wanted is None or wanted.step is None:
        return None
    since = iso(wanted.step_at) if wanted.step_at else "now"
    return (f"installing: generation {wanted.generation} is at step {wanted.step} since "
            f"{since}; its agent is silent because the installation reboots it, so Recovery "
            "leaves it alone and the guard does not count it (the step's deadline bounds it)")


def _recovery_reason(tags: dict[str, dict[str, Any]], now: dt.datetime,
                     thresholds: bmdb.Thresholds, resumed: bmdb.Resumption | None) -> str:
    started = tags.get("AgentStarted")
    if started is None:
        return "no AgentStarted tag: no agent to recover"
    gone = _gone_reason(tags.get("Provided"))
    if gone:
        return gone
    silent, why = _silence(started, tags.get("AgentHeartbeat"), now, thresholds)
    return why + _grace(resumed, now, thresholds) if silent else why


def _silence(started: dict[str, Any], heartbeat: dict[str, Any] | None, now: dt.datetime,
             thresholds: bmdb.Thresholds) -> tuple[bool, str]:
    """Whether the agent is silent by its own heartbeats, and the words for it."""
    if heartbeat is None:
        due = started["started_at"] + dt.timedelta(seconds=thresholds.first_heartbeat)
        if due > now:
            return False, (f"first heartbeat not yet due: agent started at "
                           f"{iso(started['started_at'])}, due by {iso(due)}")
        return True, (f"no heartbeat since the agent started at "
                      f"{iso(started['started_at'])}; the first was due by {iso(due)}")
    last = heartbeat["last_heartbeat_at"]
    stale_at = last + dt.timedelta(seconds=thresholds.heartbeat)
    if stale_at > now:
        return False, (f"heartbeat fresh: last at {iso(last)}, silent only after "
                       f"{iso(stale_at)}")
    return True, (f"heartbeat stale: last at {iso(last)}, older than "
                  f"{thresholds.heartbeat:g}s since {iso(stale_at)}")


def _grace(resumed: bmdb.Resumption | None, now: dt.datetime,
           thresholds: bmdb.Thresholds) -> str:
    """Why a stale machine is not silent yet: heartbeats resumed fleet-wide lately."""
    if resumed is None or resumed.grace_until(thresholds.heartbeat) <= now:
        return ""
    return (f"; but heartbeats resumed fleet-wide at {iso(resumed.at)} ({resumed.cause}), "
            f"so no machine counts as silent before "
            f"{iso(resumed.grace_until(thresholds.heartbeat))}")
