"""One machine's work, from its claim to its outcome: what every per-machine task runs.

The rules, in one place (the Celery tasks ``shepherd.agent_start``,
``shepherd.recovery`` and ``shepherd.install`` are glue over ``run_machine_work``):

* **Dispatched** (a work id, from sourcing or ``shepherd start``): the claim is
  adopted into this process's session, and what the workflow needs from the BMDB is
  read in the same transaction (one commit per machine fewer). A claim that is gone
  (adopted already: a redelivered message; or released: dispatched too late) ends
  as ``gone``, the machine untouched.
* **By hand** (no work id): the machine is claimed now under the same rules as any
  named claim (``recovery_claims.claim_one``: Recovery under the fleet-wide hold,
  after the guard with its hourly budget); a refusal raises and touches nothing.
* **Recovery asks the guard again** right before the reboot of an adopted claim (the
  callback server may have failed since the claim was sourced; the budget was spent
  by the claim). A guard that cannot decide pauses too: a reboot is the one action
  here that cannot be taken back. Paused, the claim is cancelled (no backoff).
* **The work is never left held**: the workflow finishes or fails it; what it needs
  before it runs (the provider, built on first use, and its settings) can fail
  first, and then the claim is failed here. A failure without a backoff of its own
  gets the process's configured one (``BMDB.backoff_for``). A claim that stops
  being ours mid-way ends as ``lost``: the sweep settles it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol

import bmdb
from shepherd.power import PowerControl
from shepherd.providers.base import Provider, ProviderMachine
from shepherd.workflows import guard
from shepherd.workflows.common import NOT_OURS, WorkflowResult, fail
from shepherd.workflows.guard import GuardDecision, GuardLimits
from shepherd.workflows.initializer import InitializerSettings, initialize, read_known_in
from shepherd.workflows.installation import InstallationSettings, install
from shepherd.workflows.recoverer import RecovererSettings, recover
from shepherd.workflows.recovery_claims import RecoveryPaused, claim_one

log = logging.getLogger(__name__)

Outcome = Literal["finished", "failed", "canceled", "gone", "paused", "lost"]
OnDecision = Callable[[GuardDecision], None]


class Workflow(NamedTuple):
    """A process's workflow: ``run`` works the claim with what ``read`` read from the
    BMDB in the transaction that adopted it (None for a claim made by hand, or a
    process with no ``read``: its workflow reads for itself)."""

    run: Callable[[bmdb.Work, Any], WorkflowResult]
    read: Callable[[bmdb.Tx, bmdb.BMDB, uuid.UUID], Any] | None = None


class MachineParts(Protocol):
    """What a machine's work takes from its process (``shepherd.runtime.Runtime`` is
    one): each is built when first asked for, so a failure to build it fails the claim."""

    @property
    def session(self) -> bmdb.Session: ...

    @property
    def provider(self) -> Provider: ...

    def guard_limits(self, *, interactive: bool = False) -> GuardLimits: ...

    def power_for(self, machine: ProviderMachine) -> PowerControl | None: ...

    def initializer_settings(self) -> InitializerSettings: ...

    def recoverer_settings(self) -> RecovererSettings: ...

    def installation_settings(self) -> InstallationSettings: ...


@dataclass(frozen=True)
class MachineWorkResult:
    """What one machine's work came to (a task's result: Flower shows it; no secrets)."""

    machine_id: uuid.UUID
    process: bmdb.Process
    work_id: uuid.UUID
    outcome: Outcome
    cause: str | None = None
    backoff_seconds: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"machine_id": str(self.machine_id), "process": self.process.value,
                "work_id": str(self.work_id), "outcome": self.outcome, "cause": self.cause,
                "backoff_seconds": self.backoff_seconds}


def run_machine_work(parts: MachineParts, process: bmdb.Process, machine_id: uuid.UUID,
                     work_id: uuid.UUID | None = None, *,
                     on_decision: OnDecision | None = None) -> MachineWorkResult:
    """Adopt the dispatched claim ``work_id`` (or claim ``machine_id`` by hand), ask the
    guard again for Recovery, run the process's workflow and say how it ended.

    ``on_decision`` sees every guard decision (metrics count pauses). By hand, raises
    ``bmdb.NotClaimable`` or ``RecoveryPaused`` when the machine cannot be claimed now.
    """
    workflow = _workflow(parts, process)
    read = None
    if work_id is None:
        work = _claim_by_hand(parts, process, machine_id, on_decision)
    else:
        try:
            work, read = _adopt(parts.session, workflow, process, machine_id, work_id)
        except bmdb.WorkGone:
            log.info("%s on %s: claim %s is gone (already adopted or released); nothing "
                     "done", process.value, machine_id, work_id)
            return MachineWorkResult(machine_id, process, work_id, "gone",
                                     "already adopted or released")
        if process is bmdb.Process.RECOVERY:
            paused = paused_at_execution(parts, work, on_decision)
            if paused is not None:
                log.error("RECOVERY PAUSED, not rebooting %s: %s", machine_id, paused)
                work.cancel(paused)
                return MachineWorkResult(machine_id, process, work_id, "paused", paused)
    return run(work, lambda adopted: workflow.run(adopted, read))


def _workflow(parts: MachineParts, process: bmdb.Process) -> Workflow:
    """The workflow of ``process``; its provider and settings are built when it runs."""
    if process is bmdb.Process.AGENT_START:
        return Workflow(lambda work, known: initialize(
            work, parts.provider, parts.initializer_settings(), known), read_known_in)
    if process is bmdb.Process.RECOVERY:
        return Workflow(lambda work, _: recover(work, parts.provider, parts.power_for,
                                                parts.recoverer_settings()))
    if process is bmdb.Process.OS_INSTALL:
        return Workflow(lambda work, _: install(work, parts.installation_settings(),
                                                parts.provider, parts.power_for))
    raise ValueError(f"no per-machine workflow for process {process.value!r}")


def _adopt(session: bmdb.Session, workflow: Workflow, process: bmdb.Process,
           machine_id: uuid.UUID, work_id: uuid.UUID) -> tuple[bmdb.Work, Any]:
    """Adopt the claim ``work_id`` into ``session`` and read what ``workflow`` needs, in
    one transaction (``WorkGone`` when the claim is not there to adopt).

    Should the read fail, the transaction rolls back with it: the claim is then adopted
    alone and the workflow reads for itself, so that the failure fails the claim with
    its backoff instead of leaving it to the sweep, which would hand it out again at
    once. Only a BMDB that cannot be reached, or a claim that is not ours, stops here.
    """
    read = workflow.read
    if read is None:
        return session.adopt(work_id, machine_id=machine_id, process=process), None

    def body(tx: bmdb.Tx) -> tuple[bmdb.Work, Any]:
        work = bmdb.adopt_work(tx, session, work_id, machine_id=machine_id, process=process)
        return work, read(tx, session.db, work.machine_id)

    try:
        return session.transact(body)
    except (*NOT_OURS, bmdb.Unavailable):
        raise
    except Exception:
        log.exception("%s on %s: reading with the adoption failed; adopting alone",
                      process.value, machine_id)
        return session.adopt(work_id, machine_id=machine_id, process=process), None


def _claim_by_hand(parts: MachineParts, process: bmdb.Process, machine_id: uuid.UUID,
                   on_decision: OnDecision | None) -> bmdb.Work:
    try:
        return claim_one(parts.session, process, machine_id, parts.guard_limits(),
                         on_decision=on_decision)
    except RecoveryPaused as paused:
        log.error("RECOVERY PAUSED, refusing to claim %s by hand: %s", machine_id, paused)
        raise


def paused_at_execution(parts: MachineParts, work: bmdb.Work,
                        on_decision: OnDecision | None = None) -> str | None:
    """Why Recovery must not reboot the adopted machine now, or None (the budget aside:
    the claim spent it)."""
    db = parts.session.db
    try:
        decision = guard.evaluate(db, db.thresholds, parts.guard_limits(), budget=False)
    except Exception as error:
        log.exception("recovery guard failed before rebooting %s", work.machine_id)
        return (f"{guard.PAUSED_PREFIX}the guard could not decide: "
                f"{type(error).__name__}: {error}")
    if on_decision is not None:
        on_decision(decision)
    return decision.paused


def run(work: bmdb.Work, workflow: Callable[[bmdb.Work], WorkflowResult]) -> MachineWorkResult:
    """Run ``workflow`` on ``work``; fail the claim when the workflow could not even
    start, and say ``lost`` when the claim stopped being ours."""
    try:
        result = workflow(work)
    except NOT_OURS as error:
        return lost(work, error)
    except Exception as error:
        log.exception("%s on %s: could not start the workflow", work.process.value,
                      work.machine_id)
        try:
            result = fail(work, f"worker: {type(error).__name__}: {error}")
        except NOT_OURS as lost_meanwhile:
            return lost(work, lost_meanwhile)
    return MachineWorkResult(work.machine_id, work.process, work.id, result.outcome,
                             result.cause, result.backoff_seconds)


def lost(work: bmdb.Work, error: Exception) -> MachineWorkResult:
    cause = (f"the claim was lost mid-way ({type(error).__name__}: {error}); the sweep "
             "releases it")
    log.warning("%s on %s: %s", work.process.value, work.machine_id, cause)
    return MachineWorkResult(work.machine_id, work.process, work.id, "lost", cause)
