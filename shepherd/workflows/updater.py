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

At any size: the comparison runs in the BMDB (``bmdb.listing``). The listing is
consumed once, as it comes, a chunk at a time; only the machines that differ are
written, ``batch_size`` per transaction. Python holds one chunk (a few MB) whatever
the fleet; ``bench/updater.py`` measures a million machines.

Nothing changed, nothing compared: a run whose listing has the digest of the last
run that left the tags agreeing with it, while the provider's tags have not changed
since (their revision, which the database keeps), writes nothing and skips the
comparison; it reports that run's counts. ``bmdb.listing`` states the invariant that
makes this safe (a change on either side, or a crash, means a full comparison).

Ordering: the BMDB's clock is read *before* the provider is listed, and a tag
written since is left to the next run. A machine registered in between is then
simply not judged this run; judging it against an older listing would wrongly mark
it Missing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import bmdb
from shepherd.providers.base import Provider, ProviderMachine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UpdaterSettings:
    """``batch_size``: changed tags written per transaction (fewer commits, each a
    disk flush, against shorter row locks)."""

    batch_size: int = 100

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")


@dataclass(frozen=True)
class UpdateResult:
    """What one run did (Flower shows it): counts only, so it stays small at any size.

    ``updated``: tags rewritten with a changed view; ``unchanged``: left alone;
    ``missing``: BMDB machines the provider no longer lists (``marked_missing`` of
    them written this run, the rest were Missing already); ``unregistered``: machines
    the provider lists but the BMDB lacks (reconcile's business, reported here too);
    ``compared``: False when neither side had changed since the last run that left
    them agreeing, so nothing was compared (its counts are then that state's).
    """

    provider: str
    busy: bool = False
    compared: bool = False
    updated: int = 0
    unchanged: int = 0
    missing: int = 0
    marked_missing: int = 0
    unregistered: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"provider": self.provider, "busy": self.busy, "compared": self.compared,
                "updated": self.updated,
                "unchanged": self.unchanged, "missing": self.missing,
                "marked_missing": self.marked_missing, "unregistered": self.unregistered}


def update(session: bmdb.Session, provider: Provider,
           settings: UpdaterSettings | None = None) -> UpdateResult:
    """Refresh this provider's Provided tags; write only what changed.

    A listing error propagates as the provider's typed error before any write.
    """
    settings = settings or UpdaterSettings()
    with bmdb.hold_singleton(session, f"update:{provider.name}") as held:
        if not held:
            log.info("update of %s is running elsewhere; skipping", provider.name)
            return UpdateResult(provider.name, busy=True)
        return _update_held(session, provider, settings)


def _update_held(session: bmdb.Session, provider: Provider,
                 settings: UpdaterSettings) -> UpdateResult:
    wishes: list[tuple[str, str, str]] = []
    done = bmdb.Applied()
    with bmdb.open_listing(session, provider.name) as listing:
        listing.load(listed_views(with_os_entries(provider.list_machines(), wishes)))
        seen = listing.unchanged()
        compared = seen is None
        if seen is None:
            seen = listing.compare()
            done = listing.apply(settings.batch_size)
            listing.remember(seen, done)
    if wishes:
        session.transact(lambda tx: bmdb.sync_inventory_installations(tx, provider.name,
                                                                      wishes))
    return UpdateResult(
        provider.name,
        compared=compared,
        updated=done.updated,
        unchanged=seen.stored - seen.changed - seen.to_mark,
        missing=seen.gone,
        marked_missing=done.marked_missing,
        unregistered=seen.unregistered,
    )


def with_os_entries(machines: Iterable[ProviderMachine],
                    wishes: list[tuple[str, str, str]]) -> Iterator[ProviderMachine]:
    """The listing as it comes, noting each machine's ``os`` entry on the way: an
    inventory's desired installations, applied after the Provided tags (a machine
    registered this run is then known)."""
    for machine in machines:
        if machine.os is not None:
            wishes.append((machine.provider_id, machine.os.image, machine.os.disk))
        yield machine


def listed_views(machines: Iterable[ProviderMachine]) -> Iterator[bmdb.ListedView]:
    """The part of each listed machine the Provided tag keeps, as it comes: a tuple,
    not an object, because a million of them pass through here."""
    return ((m.provider_id, m.reservation_id, m.address, m.location, m.status)
            for m in machines)
