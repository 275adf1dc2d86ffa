"""Recovery: reboot a machine whose agent went silent, and send it back to AgentStart.

Finishing drops AgentStarted and AgentHeartbeat in one transaction, which puts the
machine (still Provided, Running) back in the AgentStart backlog; the initializer
then starts a fresh agent with a fresh key.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import bmdb
from shepherd.providers.base import NotFound, Provider
from shepherd.workflows.common import (
    PERMANENT_BACKOFF,
    WorkflowFailure,
    WorkflowResult,
    provider_id_of,
    run_work,
)


@dataclass(frozen=True)
class RecovererSettings:
    """``reboot_wait``: seconds to wait after the reboot request before finishing.

    Why wait: finishing makes the machine claimable for AgentStart at once; an
    initializer arriving before the machine went down would start an agent the
    reboot then kills, costing a heartbeat timeout to notice.
    """

    reboot_wait: float = 60.0
    permanent_backoff: bmdb.Backoff = PERMANENT_BACKOFF


def recover(work: bmdb.Work, provider: Provider, settings: RecovererSettings,
            sleep: Callable[[float], None] = time.sleep) -> WorkflowResult:
    """Reboot ``work``'s machine, wait, then finish dropping its agent tags (or fail)."""

    def body() -> Callable[[bmdb.Tx], None]:
        provider_id = provider_id_of(work, provider, settings.permanent_backoff)
        work.ensure_held()
        try:
            provider.reboot(provider_id)
        except NotFound as error:
            raise WorkflowFailure(f"provider {provider.name}: device {provider_id} not "
                                  f"found: {error}", settings.permanent_backoff) from error
        if settings.reboot_wait > 0:
            sleep(settings.reboot_wait)
        return lambda tx: forget_agent(tx, work.machine_id)

    return run_work(work, body)


def forget_agent(tx: bmdb.Tx, machine_id: uuid.UUID) -> None:
    """Drop AgentStarted and AgentHeartbeat: the old agent and its key are gone."""
    bmdb.tags.delete_heartbeat(tx, machine_id)
    bmdb.tags.delete_agent_started(tx, machine_id)
