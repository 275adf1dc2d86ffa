"""Installations: the operating system a machine should have, and the one being written.

Three rows per machine, each with one writer's meaning:

* ``os_wanted``: what should be installed (image, disk selector, who asked and why).
  Written by an operator's ``shepherd install`` or an inventory's ``os`` entry
  (``want``), settled when an installation of it was verified (``installed``) or
  an operator withdrew it (``canceled``). While unsettled, the machine is in the
  installations' backlog (``backlog.installations``).
* ``os_installation_request``: the installation in flight, exactly while a
  ``ShepherdOSInstall`` work item holds the machine (the installer workflow writes
  it after its claim and deletes it before releasing the claim). Heartbeat answers
  carry it to the agent until the agent reports on its generation
  (``queries.AgentCredentials.pending_installation``).
* ``os_installation_report``: what the agent last reported, by generation.

Invariants and where they are enforced:

* A machine is only ever written for an explicit, new generation: ``dispatch``
  takes the next number from ``os_wanted.generation`` under the row's lock, so no
  two dispatches share one and none reuses a number an agent has seen (the row is
  never deleted while the machine exists; a withdrawal settles it instead). The
  agent runs a generation at most once and never one older than it has run.
* An image Shepherd serves is fetched only for the request in flight
  (``served_image_in_flight`` reads the request row, which ``settle`` deletes); the
  token that proves it is a MAC of (machine, generation, image) the server makes and
  checks (``shepherd.answer_key``), so none is ever stored.
* Work on a machine excludes itself: ``ShepherdOSInstall`` is in the agent's
  exclusion group (``vocabulary.EXCLUSION_GROUPS``), so AgentStart, Recovery and
  ``shepherd power`` never run beside an installation.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import sqlalchemy as sa

from bmdb import _schema as schema
from bmdb import history
from bmdb._database import Tx
from bmdb.tags import upsert
from bmdb.vocabulary import Event, Process

Origin = Literal["inventory", "operator"]
#: An installation's steps, in order (``shepherd.workflows.installation`` says what each
#: waits for): where ``os_wanted.step`` says the generation in flight is.
STEPS = ("rescue", "writing", "boot_device", "rebooting", "taking_over", "first_heartbeat")
#: installed: written, booted and taken over; written: written and verified on a machine
#: Shepherd cannot boot (no BMC); canceled: withdrawn by an operator.
Outcome = Literal["installed", "written", "canceled"]
#: The longest reason kept (as holds keep theirs).
MAX_REASON = 500


@dataclass(frozen=True)
class Wanted:
    """What should be installed on a machine, and whether that is settled."""

    image: str
    disk: str
    origin: str
    requested_by: str
    reason: str
    wanted_at: dt.datetime
    generation: int
    settled_at: dt.datetime | None
    outcome: str | None
    #: The step of the generation in flight (``STEPS``) and since when; None between
    #: installations.
    step: str | None = None
    step_at: dt.datetime | None = None

    @property
    def pending(self) -> bool:
        return self.settled_at is None

    @property
    def target(self) -> tuple[str | None, str | None]:
        """(image, disk): what an installation of this wish writes (``InFlight.target``)."""
        return self.image, self.disk


@dataclass(frozen=True)
class InFlight:
    """The installation dispatched to the agent, and its last reported progress."""

    generation: int
    request: dict[str, Any]
    dispatched_at: dt.datetime | None
    progress: dict[str, Any] | None
    progress_at: dt.datetime | None

    @property
    def target(self) -> tuple[str | None, str | None]:
        """(image, disk) this installation writes: a wish with another target is not the
        one it serves (``settle`` and the workflow both judge by it)."""
        return _target(self.request)

    @property
    def served_image(self) -> str | None:
        return served_image(self.request)


def served_image(request: dict[str, Any]) -> str | None:
    """The request's image name when the callback server serves it (an agent fetches it
    with a token the server adds to its answers)."""
    image = request.get("image")
    if isinstance(image, dict) and image.get("served") is True:
        return str(image.get("name"))
    return None


def _target(request: Any) -> tuple[str | None, str | None]:
    if not isinstance(request, dict):
        return None, None
    image = request.get("image")
    name = image.get("name") if isinstance(image, dict) else None
    disk = request.get("disk")
    return (name if isinstance(name, str) else None, disk if isinstance(disk, str) else None)


@dataclass(frozen=True)
class Reported:
    generation: int
    reported_at: dt.datetime
    result: dict[str, Any]


@dataclass(frozen=True)
class Installation:
    """Everything the BMDB knows of one machine's installation (each part may be absent)."""

    wanted: Wanted | None
    in_flight: InFlight | None
    report: Reported | None

    @property
    def result(self) -> dict[str, Any] | None:
        """The agent's report on the generation in flight, once it has arrived."""
        if self.in_flight is None or self.report is None:
            return None
        return self.report.result if self.report.generation == self.in_flight.generation else None


def want(tx: Tx, machine_id: uuid.UUID, *, image: str, disk: str, origin: Origin, by: str,
         reason: str) -> None:
    """Say which image the machine should have: it enters the installations' backlog.
    The row is unsettled, its generation kept (see the invariants)."""
    reason = reason[:MAX_REASON]
    upsert(tx, schema.os_wanted, {"machine_id": machine_id},
           {"image": image, "disk": disk, "origin": origin, "requested_by": by[:128],
            "reason": reason, "wanted_at": tx.now, "settled_at": None, "outcome": None})
    history.record(tx, machine_id, Process.OS_INSTALL.value, Event.WANTED,
                   f"image {image} on disk {disk}, asked by {by}: {reason}")


def withdraw(tx: Tx, machine_id: uuid.UUID, *, by: str, reason: str) -> bool:
    """Settle the wanted installation as canceled; False when none was pending. A
    dispatched one is then cancelled by its workflow, which sees the row settled."""
    w = schema.os_wanted
    done = tx.execute(sa.update(w).where(w.c.machine_id == machine_id, w.c.settled_at.is_(None))
                      .values(settled_at=tx.now, outcome="canceled")).rowcount
    if done:
        history.record(tx, machine_id, Process.OS_INSTALL.value, Event.WITHDRAWN,
                       f"withdrawn by {by}: {reason[:MAX_REASON]}")
    return bool(done)


def dispatch(tx: Tx, machine_id: uuid.UUID, request: dict[str, Any]) -> int:
    """Put ``request`` in flight under the machine's next generation; returns it.

    The generation comes from the locked ``os_wanted`` row (see the invariants)."""
    w = schema.os_wanted
    generation = tx.execute(
        sa.update(w).where(w.c.machine_id == machine_id)
        .values(generation=w.c.generation + 1, step="writing", step_at=tx.now)
        .returning(w.c.generation)).scalar_one()
    upsert(tx, schema.os_installation_request, {"machine_id": machine_id},
           {"generation": generation, "request": request, "dispatched_at": tx.now,
            "progress": None, "progress_at": tx.now})
    return int(generation)


def record_progress(tx: Tx, machine_id: uuid.UUID, generation: int,
                    progress: dict[str, Any]) -> None:
    """The agent's progress on ``generation``; ignored unless that one is in flight."""
    q = schema.os_installation_request
    tx.execute(sa.update(q).where(q.c.machine_id == machine_id, q.c.generation == generation)
               .values(progress=progress, progress_at=tx.now))


def advance(tx: Tx, machine_id: uuid.UUID, generation: int, step: str) -> bool:
    """Say that installation ``generation`` entered ``step`` (one of ``STEPS``), now;
    False when that generation is not the machine's current one."""
    if step not in STEPS:
        raise ValueError(f"no installation step {step!r}: one of {STEPS}")
    w = schema.os_wanted
    return bool(tx.execute(sa.update(w).where(w.c.machine_id == machine_id,
                                              w.c.generation == generation)
                           .values(step=step, step_at=tx.now)).rowcount)


def end_steps(tx: Tx, machine_id: uuid.UUID) -> None:
    """No installation step is under way on the machine any more (the work that set it
    is ending, whatever generation it got to: a rescue boot may fail before the first
    dispatch). Recovery and the guard count the machine again from here."""
    w = schema.os_wanted
    tx.execute(sa.update(w).where(w.c.machine_id == machine_id, w.c.step.is_not(None))
               .values(step=None, step_at=None))


def close_request(tx: Tx, machine_id: uuid.UUID, generation: int) -> dict[str, Any] | None:
    """Take installation ``generation``'s request out of the answers (its fetch token dies
    with it); the request, or None when it was not in flight. Done once the image is
    verified: the agents that answer later (the installed system's) must never get it."""
    q = schema.os_installation_request
    return tx.execute(sa.delete(q).where(q.c.machine_id == machine_id,
                                         q.c.generation == generation)
                      .returning(q.c.request)).scalar_one_or_none()


def settle(tx: Tx, machine_id: uuid.UUID, generation: int,
           outcome: Literal["installed", "written"] | None,
           target: tuple[str, str] | None = None) -> None:
    """End installation ``generation``: its request (if still in flight) leaves the
    answers, and its step is cleared; an ``outcome`` (None: it failed or was canceled)
    also settles what was wanted, if it is still what this installation wrote
    (``target``: (image, disk), needed when the request was closed before): a wish
    changed mid-way stays pending."""
    w = schema.os_wanted
    request = close_request(tx, machine_id, generation)
    end_steps(tx, machine_id)
    image, disk = target or _target(request)
    if outcome is None or image is None or disk is None:
        return
    tx.execute(sa.update(w).where(
        w.c.machine_id == machine_id, w.c.generation == generation, w.c.settled_at.is_(None),
        w.c.image == image, w.c.disk == disk).values(settled_at=tx.now, outcome=outcome))


def installation(tx: Tx, machine_id: uuid.UUID) -> Installation:
    """What the BMDB knows of the machine's installation. Its documents (the request,
    the progress, the report) are read as text and decoded here, not by the driver: one
    that does not decode, or is no JSON object, reads as empty (``None``, or ``{}`` for
    the request), so ``show``, ``explain`` and the machine's page work whatever a row
    holds (``inspection.machine_tags_as_stored`` says why)."""
    w = schema.os_wanted
    wanted = tx.execute(sa.select(w).where(w.c.machine_id == machine_id)).one_or_none()
    flight = tx.execute(_as_text(tx.dialect, "os_installation_request"),
                        {"machine": machine_id}).one_or_none()
    report = tx.execute(_as_text(tx.dialect, "os_installation_report"),
                        {"machine": machine_id}).one_or_none()
    return Installation(
        None if wanted is None else Wanted(
            wanted.image, wanted.disk, wanted.origin, wanted.requested_by, wanted.reason,
            wanted.wanted_at, wanted.generation, wanted.settled_at, wanted.outcome,
            wanted.step, wanted.step_at),
        None if flight is None else _in_flight(flight),
        None if report is None else Reported(report.generation, report.reported_at,
                                             _document(report.result) or {}))


def _in_flight(row: Any) -> InFlight:
    return InFlight(row.generation, _document(row.request) or {}, row.dispatched_at,
                    _document(row.progress), row.progress_at)


@functools.cache
def _as_text(dialect: str, name: str) -> sa.Select[Any]:
    """The table's row of one machine, its JSON columns cast to text (bytes on SQLite)."""
    table = schema.metadata.tables[name]
    raw = sa.LargeBinary if dialect == "sqlite" else sa.Text
    return sa.select(*[sa.cast(c, raw).label(c.name) if isinstance(c.type, sa.JSON) else c
                       for c in table.c]).where(table.c.machine_id == sa.bindparam("machine"))


def _document(raw: str | bytes | None) -> dict[str, Any] | None:
    """A stored JSON object, or None for anything else (absent, not JSON, too deep)."""
    if raw is None:
        return None
    try:
        value = json.loads(raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def in_progress(tx: Tx, limit: int) -> list[tuple[uuid.UUID, InFlight]]:
    """Up to ``limit`` installations in flight, the longest running first (what a
    progress screen shows)."""
    q = schema.os_installation_request
    rows = tx.execute(sa.select(q.c.machine_id).order_by(q.c.dispatched_at, q.c.machine_id)
                      .limit(limit)).scalars().all()
    shown = [(machine_id, installation(tx, machine_id).in_flight) for machine_id in rows]
    return [(machine_id, flight) for machine_id, flight in shown if flight is not None]


def served_image_in_flight(tx: Tx, machine_id: uuid.UUID) -> tuple[int, str] | None:
    """(generation, image name) of the machine's installation in flight, when its image
    is one Shepherd serves; None otherwise."""
    flight = tx.execute(_as_text(tx.dialect, "os_installation_request"),
                        {"machine": machine_id}).one_or_none()
    if flight is None:
        return None
    name = _in_flight(flight).served_image
    return None if name is None else (int(flight.generation), name)


def sync_inventory(tx: Tx, provider: str, entries: list[tuple[str, str, str]]) -> int:
    """Apply an inventory's ``os`` entries, ``(provider id, image, disk)``, as desired
    state; returns how many machines were given a new wish.

    A machine gets its entry when it has no wish yet, or when the entry changed since
    the inventory's last wish. An operator's wish (``shepherd install``) is left alone:
    a one-off installation takes precedence over the file, and the file cannot tell
    whether it meant to undo it."""
    p, w = schema.provided, schema.os_wanted
    if not entries:
        return 0
    by_id = {provider_id: (image, disk) for provider_id, image, disk in entries}
    rows = tx.execute(
        sa.select(p.c.provider_id, p.c.machine_id, w.c.image, w.c.disk, w.c.origin)
        .select_from(p.outerjoin(w, w.c.machine_id == p.c.machine_id))
        .where(p.c.provider == provider, p.c.provider_id.in_(list(by_id)))).all()
    changed = 0
    for row in rows:
        image, disk = by_id[row.provider_id]
        if row.origin == "operator" or (row.image, row.disk) == (image, disk):
            continue
        want(tx, row.machine_id, image=image, disk=disk, origin="inventory", by="inventory",
             reason="the inventory's os entry")
        changed += 1
    return changed
