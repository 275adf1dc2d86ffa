"""One machine's work, from its claim to its outcome: what every per-machine task runs.

The rules, in one place (the Celery tasks ``shepherd.agent_start``,
``shepherd.recovery`` and ``shepherd.install`` are glue over ``run_machine_work``):

* **Dispatched** (a work id, from sourcing or ``shepherd start``): the claim is
  adopted into this process's session. A claim that is gone (adopted already: a
  redelivered message; or released: dispatched too late) ends as ``gone``, the
  machine untouched.
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
from typing import Any, Literal, Protocol

import bmdb
from shepherd.power import PowerControl
from shepherd.providers.base import Provider, ProviderMachine
from shepherd.workflows import guard
from shepherd.workflows.common import NOT_OURS, WorkflowResult, fail
from shepherd.workflows.guard import GuardDecision, GuardLimits
from shepherd.workflows.initializer import InitializerSettings, initialize
from shepherd.workflows.installation import InstallationSettings, install
from shepherd.workflows.recoverer import RecovererSettings, recover
from shepherd.workflows.recovery_claims import RecoveryPaused, claim_one

log = logging.getLogger(__name__)

Outcome = Literal["finished", "failed", "canceled", "gone", "paused", "lost"]
OnDecision = Callable[[GuardDecision], None]


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
    if work_id is None:
        work = _claim_by_hand(parts, process, machine_id, on_decision)
    else:
        try:
            work = parts.session.adopt(work_id, machine_id=machine_id, process=process)
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
    return run(work, workflow)


def _workflow(parts: MachineParts,
              process: bmdb.Process) -> Callable[[bmdb.Work], WorkflowResult]:
    """The workflow of ``process``; its provider and settings are built when it runs."""
    if process is bmdb.Process.AGENT_START:
        return lambda work: initialize(work, parts.provider, parts.initializer_settings())
    if process is bmdb.Process.RECOVERY:
        return lambda work: recover(work, parts.provider, parts.power_for,
                                    parts.recoverer_settings())
    if process is bmdb.Process.OS_INSTALL:
        return lambda work: install(work, parts.installation_settings(), parts.provider,
                                    parts.power_for)
    raise ValueError(f"no per-machine workflow for process {process.value!r}")


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
