"""Installation: the workflow that has a machine's agent write and verify an OS image.

Its steps, each in the machine's history (``shepherd show``, the machine page):

1. **Dispatched** (``bmdb.dispatch_installation``): the wanted image, looked up in the
   catalog (``shepherd.images``), becomes a request under the machine's next
   generation, with a fetch token for an image Shepherd serves. From now on every
   heartbeat answer carries it to the agent, signed.
2. The agent resolves the disk, refuses what must not be written, streams the image,
   hashes it while writing, flushes, reads the disk back and hashes that again
   (``shepherd.agent.installer``), heartbeating its progress meanwhile.
3. **Verified** and Finished once the agent reports "ok" and the report holds up here
   too: the digest written and the digest read back both equal the catalog's, and the
   byte count its size. Anything else is Failed, with the agent's cause and a
   backoff; a failure after the first byte says the disk's contents are now undefined.

Rules, in one place:

* The work (``ShepherdOSInstall``, in the agent's exclusion group) is held from the
  claim to the outcome, so no AgentStart, Recovery or power command runs meanwhile;
  the request is settled (it leaves the answers, its token dies) in the transaction
  before the work is released, whatever the outcome.
* Silence is judged by the BMDB's clock against the last progress (or the dispatch):
  ``stall_timeout`` without a word fails the installation as "the agent went
  silent", and ``deadline`` bounds it as a whole, so a dead agent never holds a
  machine for ever.
* An operator's ``shepherd install --cancel`` settles what was wanted; the workflow
  sees it at its next look and cancels (no backoff), and the agent, whose answers no
  longer carry the request, stops writing.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bmdb
from shepherd.agent.protocol import IMAGES_PATH
from shepherd.images import Catalog, CatalogError, Image, UnknownImage
from shepherd.workflows.common import NOT_OURS, WorkflowFailure, WorkflowResult, fail

log = logging.getLogger(__name__)
UNDEFINED = "; the disk's contents are now undefined"
#: What a failure's cause starts with, as a bounded label (metrics): the agent's cause
#: kinds (``shepherd.agent.installer``) and this workflow's own.
CAUSE_KINDS = frozenset({
    "no_disk", "ambiguous_disk", "not_a_disk", "mounted", "swap", "own_system", "too_small",
    "bad_request", "fetch", "stall", "short_stream", "digest", "decompress", "write",
    "read_back", "deadline", "canceled", "refused", "agent_silent"})


def cause_kind(cause: str | None) -> str:
    """The kind a failure's cause names first (``digest: ...``), else "other"."""
    head = (cause or "").split(":", 1)[0].strip().replace(" ", "_")
    return head if head in CAUSE_KINDS else "other"


@dataclass(frozen=True)
class InstallationSettings:
    callback_url: str
    image_dir: Path
    #: Seconds between looks at the BMDB while the agent works.
    poll_interval: float = 1.0
    #: Seconds without progress (or, before the first, since the dispatch) after which
    #: the agent counts as gone.
    stall_timeout: float = 300.0
    #: Seconds an installation may take as a whole.
    deadline: float = 1800.0
    #: What the agent is told: how often to resume a broken fetch, and how long a fetch
    #: may go without a byte before it is resumed.
    fetch_retries: int = 5
    fetch_stall: float = 30.0


class Withdrawn(Exception):
    """An operator withdrew the installation while it was in flight."""


def install(work: bmdb.Work, settings: InstallationSettings) -> WorkflowResult:
    """Dispatch the machine's wanted installation and see it to its outcome."""
    generation: int | None = None
    try:
        image, request = prepare(work, settings)
        generation = dispatch(work, image, request)
        result = watch(work, generation, settings)
        summary = verify(result, image)
    except NOT_OURS:
        raise
    except Withdrawn as withdrawn:
        work.cancel(str(withdrawn), then=settler(work, generation))
        return WorkflowResult(work.machine_id, work.process.value, "canceled", str(withdrawn))
    except WorkflowFailure as failure:
        return fail(work, failure.cause, failure.backoff, then=settler(work, generation))
    except Exception as error:  # a bug must not leave the machine held
        log.exception("installation on %s", work.machine_id)
        return fail(work, f"unexpected {type(error).__name__}: {error}",
                    then=settler(work, generation))
    work.note(bmdb.Event.VERIFIED, summary)
    assert generation is not None
    work.finish(lambda tx: bmdb.settle_installation(tx, work.machine_id, generation,
                                                    installed=True))
    return WorkflowResult(work.machine_id, work.process.value, "finished")


def prepare(work: bmdb.Work, settings: InstallationSettings) -> tuple[Image, dict[str, Any]]:
    """The catalog's image for what is wanted, and the request the agent will get."""
    state = work.session.transact(lambda tx: bmdb.installation_of(tx, work.machine_id))
    wanted = state.wanted
    if wanted is None or not wanted.pending:
        raise Withdrawn("nothing to install: no pending installation is wanted")
    try:
        image = Catalog.load(settings.image_dir).get(wanted.image)
    except (CatalogError, UnknownImage) as error:
        raise WorkflowFailure(f"refused: {error}; nothing was written") from None
    return image, request_for(work.machine_id, image, wanted.disk, settings)


def request_for(machine_id: uuid.UUID, image: Image, disk: str,
                settings: InstallationSettings) -> dict[str, Any]:
    """The request as the agent reads it (``shepherd.agent.installer``)."""
    served = image.served
    url = (settings.callback_url.rstrip("/") + IMAGES_PATH + image.name) if served else image.url
    return {
        "kind": "image",
        # ``served``: the server adds the fetch token to its answers (never stored), so
        # a URL elsewhere never sees a token of ours.
        "image": {"name": image.name, "url": url, "sha256": image.sha256, "size": image.size,
                  "format": image.format, "served": served},
        "disk": disk,
        "machine_id": str(machine_id),
        "limits": {"retries": settings.fetch_retries, "stall_seconds": settings.fetch_stall,
                   "deadline_seconds": settings.deadline},
    }


def dispatch(work: bmdb.Work, image: Image, request: dict[str, Any]) -> int:
    def body(tx: bmdb.Tx) -> int:
        generation = bmdb.dispatch_installation(tx, work.machine_id, request)
        bmdb.record_history(tx, work.machine_id, work.process.value, bmdb.Event.DISPATCHED,
                            f"generation {generation}: image {image.name} "
                            f"({image.size} bytes, sha256 {image.sha256[:16]}…) to disk "
                            f"{request['disk']}", work_id=work.id)
        return generation

    return int(work.session.transact(body))


def watch(work: bmdb.Work, generation: int, settings: InstallationSettings) -> dict[str, Any]:
    """The agent's result for ``generation``, once it has reported."""
    started = time.monotonic()
    while True:
        work.ensure_held()
        state, now = work.session.transact(
            lambda tx: (bmdb.installation_of(tx, work.machine_id), tx.now))
        if state.wanted is None or state.wanted.outcome == "canceled":
            raise Withdrawn("canceled: an operator withdrew the installation")
        if state.in_flight is not None and state.in_flight.target != state.wanted.target:
            raise Withdrawn(f"canceled: superseded by a new wish (image {state.wanted.image} "
                            f"on disk {state.wanted.disk}), dispatched next")
        if state.in_flight is None or state.in_flight.generation != generation:
            raise WorkflowFailure(f"generation {generation} is no longer in flight")
        if state.result is not None:
            return state.result
        check_alive(state.in_flight, now, settings)
        if time.monotonic() - started > settings.deadline:
            raise WorkflowFailure(f"deadline: not done within {settings.deadline:g} s "
                                  f"({describe(state.in_flight.progress)})" + UNDEFINED)
        time.sleep(settings.poll_interval)


def check_alive(flight: bmdb.InFlight, now: Any, settings: InstallationSettings) -> None:
    last = flight.progress_at or flight.dispatched_at
    if last is None:
        return
    silent = (now - last).total_seconds()
    if silent > settings.stall_timeout:
        said = describe(flight.progress) if flight.progress else "it never started"
        # The agent may have begun writing before a heartbeat could say so.
        raise WorkflowFailure(f"agent_silent: no progress for {silent:.0f} s ({said})"
                              + UNDEFINED)


def describe(progress: dict[str, Any] | None) -> str:
    """The last progress, as a cause quotes it: "writing 512 of 1024 MiB"."""
    if not progress:
        return "no progress reported"
    done, total = progress.get("bytes_done"), progress.get("bytes_total")
    if isinstance(done, int) and isinstance(total, int) and total:
        return f"last: {progress.get('phase', '?')} {done >> 20} of {total >> 20} MiB"
    return f"last: {progress.get('phase', '?')}"


def verify(result: dict[str, Any], image: Image) -> str:
    """The history line of a good installation; ``WorkflowFailure`` with the agent's cause
    for any other, or for an "ok" whose figures do not hold up against the catalog."""
    status = result.get("status")
    if status != "ok":
        cause = str(result.get("cause") or f"the agent reported {status!r} without a cause")
        raise WorkflowFailure(f"{result.get('cause_kind') or status}: {cause}")
    written, read_back = result.get("written_sha256"), result.get("read_back_sha256")
    if written != image.sha256 or read_back != image.sha256 or result.get("bytes") != image.size:
        raise WorkflowFailure(
            f"read_back: the agent said ok, but wrote sha256 {written}, read back "
            f"{read_back} and {result.get('bytes')} bytes, where the catalog says "
            f"{image.sha256} and {image.size} bytes" + UNDEFINED)
    durations = result.get("durations") or {}
    seconds = sum(value for value in durations.values() if isinstance(value, (int, float)))
    rate = image.size / seconds / 1e6 if seconds else 0.0
    return (f"wrote {image.size} bytes of {image.name} to {result.get('disk')} and read "
            f"them back: sha256 {image.sha256} both ways, in {seconds:.1f} s "
            f"({rate:.0f} MB/s verified)")


def settler(work: bmdb.Work, generation: int | None) -> Callable[[bmdb.Tx], None] | None:
    """The ending transaction's extra change (a failure's or a cancel's): the request
    leaves the answers, in the transaction that releases the work."""
    if generation is None:
        return None
    return lambda tx: bmdb.settle_installation(tx, work.machine_id, generation, installed=False)
