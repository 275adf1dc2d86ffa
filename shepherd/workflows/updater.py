"""Update: refresh every Provided tag of one provider from a single listing.

Plain Python, no Celery: a periodic task calls ``update(session, provider, settings)``.

For each BMDB machine of the provider, the tag's (reservation id, address, location,
provider status) is compared with the provider's view, and written only if it
changed. A machine the provider no longer lists becomes ``Missing`` (its last known
reservation, address and location are kept, so an operator can still find it).

"Leave machines that did not change alone for a while", as implemented: an
unchanged machine gets *no write at all* — no row lock, no commit, and its
``Provided.updated_at`` keeps the time of its last real change, which therefore
says how long it has been stable. There is no per-machine "checked at" timer: the
one paginated listing per run already covers every machine, so skipping the
comparison would save nothing, and remembering a timer would need a BMDB column.
How often machines are looked at is the caller's schedule (``update_interval``).

Ordering: the BMDB is read *before* the provider is listed. A machine registered
in between is then simply not looked at this run; the other order would see it in
the BMDB but not in an older listing and wrongly mark it Missing.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import bmdb
from shepherd.providers.base import Provider, ProviderMachine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UpdaterSettings:
    """``batch_size``: changed tags written per transaction (each commit costs ~1 ms)."""

    batch_size: int = 100

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")


@dataclass(frozen=True)
class View:
    """The part of a Provided tag the updater keeps in step with the provider."""

    provider_id: str
    reservation_id: str | None
    address: str | None
    location: str | None
    #: A ``ProviderStatus`` (a ``StrEnum``, so it compares equal to the stored text).
    status: str

    @classmethod
    def of(cls, machine: ProviderMachine) -> View:
        return cls(machine.provider_id, machine.reservation_id, machine.address,
                   machine.location, bmdb.ProviderStatus(machine.status))

    def missing(self) -> View:
        return View(self.provider_id, self.reservation_id, self.address, self.location,
                    bmdb.ProviderStatus.MISSING)


@dataclass(frozen=True)
class UpdateResult:
    """What one run did (Flower shows it): counts only, so it stays small at any size.

    ``updated``: tags rewritten with a changed view; ``unchanged``: left alone;
    ``missing``: BMDB machines the provider no longer lists (``marked_missing`` of
    them written this run, the rest were Missing already); ``unregistered``: machines
    the provider lists but the BMDB lacks (reconcile's business, reported here too).
    """

    provider: str
    busy: bool = False
    updated: int = 0
    unchanged: int = 0
    missing: int = 0
    marked_missing: int = 0
    unregistered: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"provider": self.provider, "busy": self.busy, "updated": self.updated,
                "unchanged": self.unchanged, "missing": self.missing,
                "marked_missing": self.marked_missing, "unregistered": self.unregistered}


def update(session: bmdb.Session, provider: Provider,
           settings: UpdaterSettings | None = None) -> UpdateResult:
    """Refresh this provider's Provided tags; write only what changed.

    A listing error propagates as the provider's typed error before any write.
    """
    settings = settings or UpdaterSettings()
    with bmdb.singletons.hold(session, f"update:{provider.name}") as held:
        if not held:
            log.info("update of %s is running elsewhere; skipping", provider.name)
            return UpdateResult(provider.name, busy=True)
        return _update_held(session, provider, settings)


def _update_held(session: bmdb.Session, provider: Provider,
                 settings: UpdaterSettings) -> UpdateResult:
    stored = session.transact(lambda tx: stored_views(tx, provider.name))
    listed = {m.provider_id: View.of(m) for m in provider.list_machines()}
    gone = {mid for mid, old in stored.items() if old.provider_id not in listed}
    changes: dict[uuid.UUID, View] = {}
    for machine_id, old in stored.items():
        new = old.missing() if machine_id in gone else listed[old.provider_id]
        if new != old:
            changes[machine_id] = new
    written = set(write_changes(session, provider.name, changes, settings.batch_size))
    known = {v.provider_id for v in stored.values()}
    return UpdateResult(
        provider.name,
        updated=len(written - gone),
        unchanged=len(stored) - len(changes),
        missing=len(gone),
        marked_missing=len(written & gone),
        unregistered=len(set(listed) - known),
    )


def stored_views(tx: bmdb.Tx, provider: str,
                 machine_ids: Iterable[uuid.UUID] | None = None) -> dict[uuid.UUID, View]:
    """machine id -> the stored view, for ``provider``'s machines (or some of them)."""
    return {
        machine_id: View(state.provider_id, state.reservation_id, state.address,
                         state.location, state.provider_status)
        for machine_id, state in bmdb.queries.provided_states(tx, provider, machine_ids).items()
    }


def write_changes(session: bmdb.Session, provider: str, changes: dict[uuid.UUID, View],
                  batch_size: int) -> list[uuid.UUID]:
    """Write ``changes`` a batch per transaction; return the machines actually written."""
    written: list[uuid.UUID] = []
    items = list(changes.items())
    for start in range(0, len(items), batch_size):
        batch = dict(items[start:start + batch_size])
        written += session.transact(lambda tx, batch=batch: _apply(tx, provider, batch))
    return written


def _apply(tx: bmdb.Tx, provider: str, batch: dict[uuid.UUID, View]) -> list[uuid.UUID]:
    """Write each view that still differs from the row as it is *now*.

    Re-reading inside the transaction skips machines deleted meanwhile (an upsert
    would re-create a tag for a deleted machine, or fail the whole batch on the
    foreign key) and rows another writer already brought up to date.
    """
    current = stored_views(tx, provider, batch)
    written = []
    for machine_id, view in batch.items():
        if current.get(machine_id) in (None, view):
            continue
        bmdb.tags.upsert_provided(
            tx, machine_id, provider=provider, provider_id=view.provider_id,
            provider_status=view.status, reservation_id=view.reservation_id,
            address=view.address, location=view.location,
        )
        written.append(machine_id)
    return written
