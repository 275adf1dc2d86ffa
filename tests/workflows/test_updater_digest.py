"""The updater's skip: a run whose listing and tags are as at the last agreeing pass
writes nothing and compares nothing; any change on either side, and any crash, still
leads to a full comparison and its repair (the invariant of ``bmdb.listing``).

Real BMDB (PostgreSQL and SQLite, with the revision triggers of migration 0011); the
provider is a plain listing. ``compared`` counts the comparisons each test causes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

import bmdb
from bmdb import _schema as schema
from bmdb import provided_revisions
from shepherd.providers.base import ProviderMachine
from shepherd.workflows.updater import UpdaterSettings, listed_views, update
from tests.workflows.test_updater import RACK, Rack, machine, register, tags

pytestmark = pytest.mark.timeout(60)

Status = bmdb.ProviderStatus
MOVED = "198.51.100.7"


@pytest.fixture
def compared(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Providers whose listing was compared in full, in order (a spy on the real one)."""
    calls: list[str] = []
    real = bmdb.listing.Listing.compare

    def spy(self: bmdb.listing.Listing) -> bmdb.listing.Comparison:
        calls.append(self.provider)
        return real(self)

    monkeypatch.setattr(bmdb.listing.Listing, "compare", spy)
    return calls


@pytest.fixture
def fleet(session: bmdb.Session) -> list[ProviderMachine]:
    """Four registered machines, and one run that found them agreeing."""
    machines = [machine(f"m{i}") for i in range(4)]
    register(session, *machines)
    assert update(session, Rack(machines)).unchanged == 4
    return machines


def state(session: bmdb.Session) -> tuple[Any, ...]:
    """Everything the updater could write: the tags, the agreement, the revisions."""
    def read(tx: bmdb.Tx) -> tuple[Any, ...]:
        return tuple(tx.execute(sa.select(table).order_by(*table.primary_key)).all()
                     for table in (schema.listing_digests, schema.provided_revisions))
    return tags(session, RACK), session.transact(read)


def sql(session: bmdb.Session, statement: str, **values: Any) -> None:
    """An operator's SQL, behind every Shepherd function."""
    session.transact(lambda tx: tx.execute(sa.text(statement), values))


def test_nothing_changed_writes_and_compares_nothing(session, fleet, compared):
    before = state(session)
    result = update(session, Rack(fleet))
    assert compared == [] and not result.compared
    assert (result.updated, result.unchanged, result.missing, result.unregistered) == (0, 4, 0, 0)
    assert state(session) == before


def test_the_skip_reports_what_a_comparison_would(session, compared, monkeypatch):
    """Missing and unregistered machines counted as a full comparison counts them now
    (the machine Missing already is unchanged: it is not written)."""
    register(session, machine("a"), machine("gone"))
    listing = Rack([machine("a"), machine("stray")])
    first = update(session, listing)
    assert (first.marked_missing, first.missing, first.unregistered) == (1, 1, 1)
    skipped = update(session, listing)
    assert compared == [RACK]
    monkeypatch.setattr(bmdb.listing.Listing, "unchanged", lambda self: None)
    assert dataclasses.replace(skipped, compared=True) == update(session, listing)
    assert compared == [RACK, RACK]
    assert (skipped.unchanged, skipped.missing, skipped.marked_missing) == (2, 1, 0)


@pytest.mark.parametrize("operator_sql", [
    "UPDATE provided SET address = '203.0.113.1' WHERE provider_id = 'm1'",
    "UPDATE provided SET provider_status = 'Missing' WHERE provider_id = 'm1'",
])
def test_a_tag_changed_behind_our_back_is_repaired(session, fleet, compared, operator_sql):
    sql(session, operator_sql)
    assert update(session, Rack(fleet)).updated == 1
    assert compared == [RACK]
    assert tags(session, RACK)["m1"]["address"] == fleet[1].address
    assert tags(session, RACK)["m1"]["provider_status"] == Status.RUNNING


@pytest.mark.parametrize(("operator_sql", "missing"), [
    ("UPDATE provided SET provider_id = 'm1-renamed' WHERE provider_id = 'm1'", 1),
    ("UPDATE provided SET provider = 'elsewhere' WHERE provider_id = 'm1'", 0),
])
def test_a_tag_moved_behind_our_back_is_seen(session, fleet, compared, operator_sql, missing):
    """Not the updater's to move back (reconcile's business), but counted at once."""
    sql(session, operator_sql)
    result = update(session, Rack(fleet))
    assert compared == [RACK]
    assert (result.unregistered, result.missing, result.marked_missing) == (1, missing, missing)


def test_a_machine_registered_with_an_older_view_is_repaired(session, fleet, compared):
    """Reconcile registers a machine the listing lists already, from an older listing."""
    late = machine("late")
    register(session, dataclasses.replace(late, address=MOVED))
    result = update(session, Rack([*fleet, late]))  # the listing changed too: compared
    assert (result.updated, tags(session, RACK)["late"]["address"]) == (1, late.address)
    register(session, dataclasses.replace(late, status=Status.STOPPED))  # same listing now
    result = update(session, Rack([*fleet, late]))
    assert compared == [RACK, RACK]
    assert tags(session, RACK)["late"]["provider_status"] == Status.RUNNING


def test_a_deleted_machine_is_counted_unregistered(session, fleet, compared):
    machine_id = session.transact(lambda tx: bmdb.provided_by_provider_id(tx, RACK))["m2"]
    session.transact(lambda tx: bmdb.delete_machine(tx, machine_id))
    result = update(session, Rack(fleet))
    assert compared == [RACK]
    assert (result.unchanged, result.unregistered) == (3, 1)


def test_a_changed_listing_is_compared(session, fleet, compared):
    moved = [dataclasses.replace(fleet[0], address=MOVED), *fleet[1:]]
    assert update(session, Rack(moved)).updated == 1
    assert update(session, Rack(fleet[::-1])).updated == 1  # back, in another order
    assert update(session, Rack(fleet[:3])).marked_missing == 1
    assert compared == [RACK] * 3
    assert tags(session, RACK)["m3"]["provider_status"] == Status.MISSING


def test_after_our_own_writes_the_next_run_skips(session, fleet, compared):
    moved = [dataclasses.replace(m, address=MOVED) for m in fleet]
    assert update(session, Rack(moved), UpdaterSettings(batch_size=3)).updated == 4
    before = state(session)
    assert update(session, Rack(moved)).unchanged == 4
    assert compared == [RACK]
    assert state(session) == before


def test_marker_writes_do_not_count_as_changes(session, fleet, compared):
    """AgentStart writes ``provided.agent_started``: not the provider's view."""
    machine_id = session.transact(lambda tx: bmdb.provided_by_provider_id(tx, RACK))["m0"]
    session.transact(lambda tx: bmdb.set_agent_started(tx, machine_id, bytes(32)))
    update(session, Rack(fleet))
    assert compared == []


def test_a_change_during_a_pass_is_not_taken_for_agreement(session, fleet, compared):
    """A tag edited between the comparison and the writes: the pass writes what it
    found, but cannot vouch for the tags afterwards; the next run compares again."""
    moved = [dataclasses.replace(fleet[0], address=MOVED), *fleet[1:]]
    with bmdb.open_listing(session, RACK) as listing:
        listing.load(listed_views(moved))
        seen = listing.compare()
        sql(session, "UPDATE provided SET location = 'elsewhere' WHERE provider_id = 'm2'")
        done = listing.apply(batch_size=10)
        assert done.updated == 1
        assert not listing.remember(seen, done)
    assert update(session, Rack(moved)).updated == 1
    assert tags(session, RACK)["m2"]["location"] == fleet[2].location
    assert compared == [RACK, RACK]  # this test's, then the next run's


def test_a_machine_registered_during_the_listing_means_a_full_pass_next(session, fleet,
                                                                        compared):
    """Left to the next run by the watermark: that run must compare, not skip."""
    late = machine("late", address=MOVED)

    class RegistersWhileListing(Rack):
        def list_machines(self) -> Iterator[ProviderMachine]:
            register(session, late)
            return iter([*fleet, machine("late")])

    update(session, RegistersWhileListing(fleet))
    assert tags(session, RACK)["late"]["address"] == MOVED  # newer than the listing
    update(session, Rack([*fleet, machine("late")]))
    assert compared == [RACK, RACK]
    assert tags(session, RACK)["late"]["address"] == machine("late").address


def test_a_crash_amid_the_writes_is_finished_by_the_next_run(session, fleet, compared,
                                                             monkeypatch):
    moved = [dataclasses.replace(m, address=MOVED) for m in fleet]
    refresh, batches = bmdb.tags.refresh_provided, []

    def crashes_on_the_second_batch(*args: Any, **kwargs: Any) -> int:
        batches.append(1)
        if len(batches) == 2:
            raise RuntimeError("worker killed")
        return refresh(*args, **kwargs)

    monkeypatch.setattr(bmdb.tags, "refresh_provided", crashes_on_the_second_batch)
    with pytest.raises(RuntimeError):
        update(session, Rack(moved), UpdaterSettings(batch_size=2))
    assert sum(t["address"] == MOVED for t in tags(session, RACK).values()) == 2
    monkeypatch.setattr(bmdb.tags, "refresh_provided", refresh)
    assert update(session, Rack(moved)).updated == 2
    assert {t["address"] for t in tags(session, RACK).values()} == {MOVED}
    assert compared == [RACK, RACK]


def test_a_crash_before_the_agreement_is_recorded_means_a_full_pass(session, fleet,
                                                                    compared, monkeypatch):
    moved = [dataclasses.replace(fleet[0], address=MOVED), *fleet[1:]]
    remember = bmdb.listing.Listing.remember

    def crash(*args: Any) -> bool:
        raise RuntimeError("worker killed")

    monkeypatch.setattr(bmdb.listing.Listing, "remember", crash)
    with pytest.raises(RuntimeError):
        update(session, Rack(moved))
    monkeypatch.setattr(bmdb.listing.Listing, "remember", remember)
    assert update(session, Rack(moved)).updated == 0  # compared: nothing left to write
    assert update(session, Rack(moved)).updated == 0  # agreed: skipped
    assert compared == [RACK, RACK]


def test_revisions_count_every_change_of_a_view_and_nothing_else(session):
    """The triggers' invariant (``bmdb.provided_revisions``), directly."""
    def revision(provider: str = RACK) -> int:
        return session.transact(lambda tx: provided_revisions.revision(tx, provider))

    ids = register(session, machine("a"), machine("b"))
    assert revision() == 2
    sql(session, "UPDATE provided SET updated_at = updated_at, agent_started = true")
    sql(session, "UPDATE provided SET address = address")
    assert revision() == 2
    sql(session, "UPDATE provided SET reservation_id = NULL WHERE provider_id = 'a'")
    assert revision() == 3
    sql(session, "UPDATE provided SET provider = 'other' WHERE provider_id = 'b'")
    assert (revision(), revision("other")) == (4, 1)
    session.transact(lambda tx: bmdb.delete_machine(tx, ids["a"]))  # a cascade
    assert revision() == 5
