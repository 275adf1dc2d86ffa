"""What every per-machine workflow shares: its result, its failures, and the rule that
the work is finished or failed before the workflow returns.

Only ``WorkGone`` / ``SessionExpired`` (the claim is no longer ours, nothing to
release) and ``CommitOutcomeUnknown`` (the sweep settles it) propagate.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import bmdb
from shepherd.providers.base import NotSupported, Provider, ProviderError

log = logging.getLogger(__name__)

#: For failures a retry in minutes cannot fix (the provider no longer knows the
#: device, the machine has no Provided tag, the provider cannot reboot): the
#: reconcile/update loops or an operator must act first, so try again rarely.
PERMANENT_BACKOFF = bmdb.Backoff(initial=30 * 60, maximum=24 * 3600, exponent=2.0)
MAX_CAUSE = 1000
#: Errors that mean the claim is not ours any more: nothing to release, so re-raise.
NOT_OURS = (bmdb.WorkGone, bmdb.SessionExpired, bmdb.CommitOutcomeUnknown)

#: "canceled": released without a backoff (an operator withdrew what was asked).
Outcome = Literal["finished", "failed", "canceled"]


class WorkflowFailure(Exception):
    """A failure with its cause text and, optionally, a backoff fitting it and more
    changes to make in the failing transaction (``then``)."""

    def __init__(self, cause: str, backoff: bmdb.Backoff | None = None,
                 then: Callable[[bmdb.Tx], None] | None = None) -> None:
        super().__init__(cause)
        self.cause = cause
        self.backoff = backoff
        self.then = then


@dataclass(frozen=True)
class WorkflowResult:
    """What a task reports (Flower shows it): no keys, no secrets."""

    machine_id: uuid.UUID
    process: str
    outcome: Outcome
    cause: str | None = None
    backoff_seconds: int | None = None

    @property
    def ok(self) -> bool:
        return self.outcome == "finished"

    def to_json(self) -> dict[str, Any]:
        return {"machine_id": str(self.machine_id), "process": self.process,
                "outcome": self.outcome, "cause": self.cause,
                "backoff_seconds": self.backoff_seconds}


def provider_id_of(work: bmdb.Work, provider: Provider, permanent: bmdb.Backoff) -> str:
    """The machine's provider id from its Provided tag (which must be this provider's),
    read in a transaction of its own."""
    provided = work.session.transact(
        lambda tx: bmdb.machine_tag(tx, "Provided", work.machine_id))
    return provider_id_from(provided, provider, permanent)


def provider_id_from(provided: Mapping[str, Any] | None, provider: Provider,
                     permanent: bmdb.Backoff) -> str:
    """The provider id in a Provided tag already read (``bmdb.machine_tag``),
    which must exist and be ``provider``'s."""
    if provided is None:
        raise WorkflowFailure("bmdb: machine has no Provided tag", permanent)
    if provided["provider"] != provider.name:
        raise WorkflowFailure(f"bmdb: machine is provided by {provided['provider']!r}, "
                              f"not {provider.name!r}", permanent)
    return str(provided["provider_id"])


def run_work(work: bmdb.Work, body: Callable[[], Callable[[bmdb.Tx], None]]) -> WorkflowResult:
    """Run ``body`` (slow, outside any transaction), then finish with the tag changes it
    returns, or fail with a cause: the work is never left held."""
    try:
        apply = body()
    except NOT_OURS:
        raise
    except WorkflowFailure as failure:
        return fail(work, failure.cause, failure.backoff, failure.then)
    except NotSupported as error:
        return fail(work, f"provider: not supported: {error}", PERMANENT_BACKOFF)
    except ProviderError as error:
        return fail(work, f"provider: {type(error).__name__}: {error}")
    except Exception as error:  # a bug must not leave the machine held
        log.exception("unexpected error in %s on %s", work.process, work.machine_id)
        return fail(work, f"unexpected {type(error).__name__}: {error}")
    try:
        work.finish(apply)
    except NOT_OURS:
        raise
    except Exception as error:  # the finish rolled back: the claim is still ours
        log.exception("finishing %s on %s failed", work.process, work.machine_id)
        return fail(work, f"bmdb: recording the result failed: {type(error).__name__}: {error}")
    return WorkflowResult(work.machine_id, work.process.value, "finished")


def fail(work: bmdb.Work, cause: str, backoff: bmdb.Backoff | None = None,
         then: Callable[[bmdb.Tx], None] | None = None) -> WorkflowResult:
    """Fail the work (default backoff of its process unless one is given) and say so."""
    cause = cause if len(cause) <= MAX_CAUSE else cause[: MAX_CAUSE - 3] + "..."
    log.warning("%s failed on %s: %s", work.process.value, work.machine_id, cause)
    interval = work.fail(cause, backoff, then)
    return WorkflowResult(work.machine_id, work.process.value, "failed", cause, interval)
