"""Update against the simulator (real HTTP) and a real BMDB (PostgreSQL and SQLite)."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

import bmdb
from bmdb._database import run_transaction
from shepherd.providers.base import (
    Capacity,
    ProviderMachine,
    TransientExhausted,
    register_provided,
)
from shepherd.providers.equinix import EquinixProvider
from shepherd.simulator import Simulator
from shepherd.workflows.provisioner import ProvisionerSettings, reconcile
from shepherd.workflows.updater import UpdaterSettings, listed_views, update

pytestmark = pytest.mark.timeout(60)

Status = bmdb.ProviderStatus


@pytest.fixture
def fleet(session: bmdb.Session, provider: EquinixProvider, simulator: Simulator) -> list[str]:
    """Three machines, registered by reconcile, that stay provisioning until a test
    says otherwise (so no state changes on its own while the test looks)."""
    simulator.state.provision_delay = 3600.0
    settings = ProvisionerSettings(max_machines=3, chunk_size=3, creation_rate=0.0)
    return list(reconcile(session, provider, settings).created)


def tags(session: bmdb.Session, provider: str = "equinix") -> dict[str, dict[str, Any]]:
    """provider id -> Provided row."""
    p = bmdb._schema.provided
    rows = session.transact(lambda tx: tx.execute(sa.select(p).where(p.c.provider == provider))
                            .mappings().all())
    return {row["provider_id"]: dict(row) for row in rows}


def activate(sim: Simulator, device_id: str) -> None:
    with sim.state.lock:
        sim.state.devices[device_id].provision_delay = 0.0


def vanish(sim: Simulator, device_id: str) -> None:
    """The device is gone from the provider's listing (deleted behind our back)."""
    with sim.state.lock:
        device = sim.state.devices.pop(device_id)
        sim.state.reservations[device.reservation_id].device_id = None


def test_unchanged_machines_are_left_alone(session, provider, fleet):
    before = tags(session)
    result = update(session, provider)
    assert (result.updated, result.unchanged, result.missing) == (0, 3, 0)
    assert tags(session) == before  # updated_at included: no write at all


def test_status_change_is_reflected(session, provider, simulator, fleet):
    assert {t["provider_status"] for t in tags(session).values()} == {Status.PROVISIONING}
    activate(simulator, fleet[0])
    before = tags(session)
    result = update(session, provider)
    assert (result.updated, result.unchanged) == (1, 2)
    after = tags(session)
    assert after[fleet[0]]["provider_status"] == Status.RUNNING
    assert after[fleet[0]]["updated_at"] >= before[fleet[0]]["updated_at"]
    assert {k: after[k] for k in fleet[1:]} == {k: before[k] for k in fleet[1:]}


def test_address_change_is_reflected(session, provider, simulator, fleet):
    with simulator.state.lock:
        simulator.state.devices[fleet[1]].address = "127.100.9.9"
    result = update(session, provider)
    assert result.updated == 1
    assert tags(session)[fleet[1]]["address"] == "127.100.9.9"


def test_location_change_is_reflected(session, provider, simulator, fleet):
    with simulator.state.lock:
        device = simulator.state.devices[fleet[2]]
        device.facility = "ny7" if device.facility != "ny7" else "fr2"
        moved_to = device.facility
    assert update(session, provider).updated == 1
    assert tags(session)[fleet[2]]["location"] == moved_to


def test_vanished_device_becomes_missing_once(session, provider, simulator, fleet):
    before = tags(session)[fleet[0]]
    vanish(simulator, fleet[0])
    first = update(session, provider)
    assert (first.missing, first.marked_missing, first.updated, first.unchanged) == (1, 1, 0, 2)
    gone = tags(session)[fleet[0]]
    assert gone["provider_status"] == Status.MISSING
    assert (gone["address"], gone["reservation_id"]) == (before["address"],
                                                         before["reservation_id"])
    second = update(session, provider)
    assert (second.missing, second.marked_missing) == (1, 0)
    assert tags(session)[fleet[0]] == gone  # Missing already: not rewritten


def test_many_changes_in_small_batches(session, provider, simulator, fleet):
    for device_id in fleet:
        activate(simulator, device_id)
    result = update(session, provider, UpdaterSettings(batch_size=2))
    assert result.updated == 3
    assert {t["provider_status"] for t in tags(session).values()} == {Status.RUNNING}
    assert json.loads(json.dumps(result.to_json()))["updated"] == 3


def test_other_providers_and_unregistered_devices_are_not_touched(session, provider,
                                                                   simulator, fleet):
    rack = ProviderMachine("rack-1", "192.0.2.9", 22, "fra1", None, Status.RUNNING, False)
    session.transact(lambda tx: register_provided(tx, "static", rack))
    static_before = tags(session, "static")
    reservation = simulator.state.project_reservations()[-1]
    simulator.create_device({"metro": reservation.metro, "plan": reservation.plan,
                             "operating_system": "ubuntu_22_04",
                             "hostname": "shepherd-test-stray",
                             "hardware_reservation_id": reservation.id})
    result = update(session, provider)
    assert (result.unregistered, result.updated, result.missing) == (1, 0, 0)
    assert tags(session, "static") == static_before
    assert set(tags(session)) == set(fleet)


def test_deleted_machine_is_skipped_not_recreated(session, provider, simulator, fleet):
    machine_id = session.transact(
        lambda tx: bmdb.provided_by_provider_id(tx, provider.name))[fleet[0]]
    activate(simulator, fleet[0])

    class DeletesDuringListing:
        """An operator deletes the machine between our BMDB read and the listing."""

        name = provider.name

        def list_machines(self) -> Iterable[ProviderMachine]:
            session.transact(lambda tx: bmdb.delete_machine(tx, machine_id))
            return provider.list_machines()

    result = update(session, DeletesDuringListing())  # type: ignore[arg-type]
    assert result.updated == 0
    assert fleet[0] not in tags(session)
    assert not session.transact(lambda tx: bmdb.machine_exists(tx, machine_id))


def test_api_down_propagates_and_nothing_is_written(session, provider, simulator, fleet):
    activate(simulator, fleet[0])
    before = tags(session)
    simulator.faults.set(api_error_rate=1.0)
    with pytest.raises(TransientExhausted):
        update(session, provider)
    simulator.stop()
    with pytest.raises(TransientExhausted):
        update(session, provider)
    assert tags(session) == before


def test_one_update_per_provider_at_a_time(db, session, provider, simulator, fleet):
    activate(simulator, fleet[0])
    with db.start_session("other", interval=30) as other, \
            bmdb.hold_singleton(other, f"update:{provider.name}"):
        assert update(session, provider).busy
    assert update(session, provider).updated == 1


def test_settings_refuse_nonsense():
    with pytest.raises(ValueError):
        UpdaterSettings(batch_size=0)


# -- at any size: the listing compared in the BMDB (bmdb.listing) ------------------------
# These use a provider without HTTP, whose listing each test sets.


RACK = "rack"


def machine(provider_id: str, **changes: Any) -> ProviderMachine:
    base = ProviderMachine(provider_id, f"192.0.2.{len(provider_id)}", 22, "fra1", "r-1",
                           Status.RUNNING, False)
    return dataclasses.replace(base, **changes)


@dataclasses.dataclass
class Rack:
    """A provider listing ``machines`` (an iterator each time, as a streaming one).
    ``update`` only lists; the rest of ``Provider`` is there to be one."""

    machines: list[ProviderMachine]
    name: str = RACK
    authoritative: bool = False

    def list_machines(self) -> Iterator[ProviderMachine]:
        return iter(self.machines)

    def get_machine(self, provider_id: str) -> ProviderMachine:
        raise NotImplementedError("update only lists")

    def list_capacity(self) -> list[Capacity]:
        raise NotImplementedError("update only lists")

    def create_machine(self, capacity: Capacity) -> ProviderMachine:
        raise NotImplementedError("update only lists")

    def reboot(self, provider_id: str) -> None:
        raise NotImplementedError("update only lists")


def register(session: bmdb.Session, *machines: ProviderMachine) -> dict[str, Any]:
    """provider id -> machine id of each, registered as Provided now."""
    return {m.provider_id: session.transact(functools.partial(register_provided, provider=RACK,
                                                              machine=m))
            for m in machines}


def test_odd_values_travel_exactly_and_then_compare_equal(session):
    """What COPY's CSV must quote (tabs, newlines, quotes, carriage returns) and what it
    must not take for NULL (an empty string, a backslash-N) arrive as they were; the
    next run finds nothing changed."""
    plain = [machine(f"m{i}") for i in range(4)]
    register(session, *plain)
    odd = [
        machine("m0", address="tab\there", location="line\nbreak", reservation_id='quo"te'),
        machine("m1", address="", location="\\N", reservation_id="back\\slash"),
        machine("m2", address=None, location=" Zürich ✓ ", reservation_id="cr\rlf\r\n"),
        machine("m3", address="\t", location='"', reservation_id=None),
    ]
    first = update(session, Rack(odd))
    assert (first.updated, first.unchanged) == (4, 0)
    stored = tags(session, RACK)
    for m in odd:
        assert (stored[m.provider_id]["address"], stored[m.provider_id]["location"],
                stored[m.provider_id]["reservation_id"]) == (m.address, m.location,
                                                             m.reservation_id)
    second = update(session, Rack(odd))
    assert (second.updated, second.unchanged) == (0, 4)
    assert tags(session, RACK) == stored


def test_listing_loads_in_many_chunks(session, monkeypatch):
    monkeypatch.setattr(bmdb.listing, "CHUNK_ROWS", 2)
    monkeypatch.setattr(bmdb.listing, "_COPY_READ", 7)
    machines = [machine(f"m{i}") for i in range(7)]
    register(session, *machines)
    moved = [dataclasses.replace(m, address="198.51.100.1") if i % 3 == 0 else m
             for i, m in enumerate(machines)]
    result = update(session, Rack(moved))
    assert (result.updated, result.unchanged, result.missing) == (3, 4, 0)
    assert {k for k, t in tags(session, RACK).items()
            if t["address"] == "198.51.100.1"} == {"m0", "m3", "m6"}


def test_machine_registered_during_the_listing_is_not_marked_missing(session):
    known = [machine("a"), machine("b")]
    register(session, *known)
    late = machine("late")

    class RegistersWhileListing(Rack):
        """Reconcile registers a machine after this listing was taken."""

        def list_machines(self) -> Iterator[ProviderMachine]:
            register(session, late)
            return iter(known)

    result = update(session, RegistersWhileListing(known))
    assert (result.missing, result.marked_missing, result.updated) == (0, 0, 0)
    assert tags(session, RACK)["late"]["provider_status"] == Status.RUNNING


def test_machine_deleted_before_its_batch_is_skipped(session):
    machine_ids = register(session, machine("a"), machine("b"))
    moved = [machine("a", address="198.51.100.1"), machine("b", address="198.51.100.2")]
    with bmdb.open_listing(session, RACK) as listing:
        listing.load(listed_views(moved))
        seen = listing.compare()
        session.transact(lambda tx: bmdb.delete_machine(tx, machine_ids["a"]))
        done = listing.apply(batch_size=10)
    assert (seen.changed, done.updated) == (2, 1)
    assert set(tags(session, RACK)) == {"b"}
    assert not session.transact(lambda tx: bmdb.machine_exists(tx, machine_ids["a"]))


def test_tag_rewritten_after_the_listing_began_is_left_to_the_next_run(session):
    """A tag written since the watermark (reconcile registering the machine again) may
    be newer than the listing: neither its change nor its absence is written."""
    register(session, machine("a"), machine("b"))
    with bmdb.open_listing(session, RACK) as listing:
        listing.load(listed_views([machine("a", address="198.51.100.1")]))  # b not listed
        seen = listing.compare()
        register(session, machine("a", address="198.51.100.77"), machine("b", location="x"))
        done = listing.apply(batch_size=10)
    assert (seen.changed, seen.to_mark, done.updated, done.marked_missing) == (1, 1, 0, 0)
    after = tags(session, RACK)
    assert (after["a"]["address"], after["b"]["provider_status"]) == ("198.51.100.77",
                                                                      Status.RUNNING)


def test_writes_are_batched(session, monkeypatch):
    """At most ``batch_size`` machines written per transaction, changed and Missing
    together, whatever their order."""
    machines = [machine(f"m{i}") for i in range(7)]
    register(session, *machines)
    listed = [dataclasses.replace(m, status=Status.STOPPED) for m in machines[:4]]
    per_transaction: list[int] = []
    refresh, mark = bmdb.refresh_provided, bmdb.mark_provided_missing

    def counted_refresh(*args: Any, **kwargs: Any) -> int:
        per_transaction.append(refresh(*args, **kwargs))
        return per_transaction[-1]

    def counted_mark(*args: Any, **kwargs: Any) -> int:
        written = mark(*args, **kwargs)
        per_transaction[-1] += written  # the same transaction as the refresh before it
        return written

    monkeypatch.setattr(bmdb.tags, "refresh_provided", counted_refresh)
    monkeypatch.setattr(bmdb.tags, "mark_provided_missing", counted_mark)
    result = update(session, Rack(listed), UpdaterSettings(batch_size=3))
    assert per_transaction == [3, 3, 1]
    assert (result.updated, result.marked_missing, result.missing) == (4, 3, 3)


def test_no_transaction_is_open_while_the_provider_lists(db, session, monkeypatch):
    """Another writer of Provided rows (the ``agent_started`` marker) does not wait
    while the provider is being listed. On SQLite an open transaction would hold the
    write lock; on PostgreSQL loading locks no row in the first place."""
    monkeypatch.setattr(bmdb.listing, "CHUNK_ROWS", 1)
    machines = [machine("a"), machine("b"), machine("c")]
    machine_ids = register(session, *machines)

    def slow_listing() -> Iterator[ProviderMachine]:
        yield from machines[:2]  # the first chunk is loaded by now
        with db.start_session("initializer", interval=30) as other:
            other.transact(lambda tx: bmdb.set_agent_started(
                tx, machine_ids["b"], bytes(32)), give_up_after=1)
        yield machines[2]

    class Slow(Rack):
        def list_machines(self) -> Iterator[ProviderMachine]:
            return slow_listing()

    assert update(session, Slow(machines)).unchanged == 3
    assert tags(session, RACK)["b"]["agent_started"]


def test_repeated_and_unregistered_ids_are_counted_once(session):
    register(session, machine("a"), machine("b"))
    listed = [machine("a"), machine("a", address="198.51.100.1"), machine("b"),
              machine("stray"), machine("stray")]
    result = update(session, Rack(listed))
    assert (result.updated, result.unchanged, result.unregistered) == (1, 1, 1)
    assert tags(session, RACK)["a"]["address"] == "198.51.100.1"


def test_unknown_status_is_refused_and_nothing_written(session):
    register(session, machine("a"), machine("b"))
    before = tags(session, RACK)
    listed = [machine("a", address="198.51.100.1"), machine("b", status="Exploded")]
    with pytest.raises(sa.exc.IntegrityError):
        update(session, Rack(listed))
    assert tags(session, RACK) == before


def test_other_providers_tags_are_neither_compared_nor_written(session):
    register(session, machine("a"))
    other = machine("a", address="203.0.113.9")
    session.transact(lambda tx: register_provided(tx, "elsewhere", other))
    result = update(session, Rack([]))
    assert (result.missing, result.marked_missing, result.unregistered) == (1, 1, 0)
    assert tags(session, "elsewhere")["a"]["provider_status"] == Status.RUNNING


def test_a_pinned_transaction_is_retried_on_its_own_connection(db):
    """The listing's tables live on one connection: a transient error (here SQLite's
    busy file) runs the body again there, not on a pooled one."""
    ran_on: list[sa.Connection] = []

    def body(tx: bmdb.Tx) -> str:
        ran_on.append(tx.conn)
        if len(ran_on) == 1:
            raise sa.exc.OperationalError("BEGIN", {}, Exception("database is locked"))
        return "done"

    with db.engine.connect() as pinned:
        assert run_transaction(db.engine, body, connection=pinned) == "done"
    assert ran_on == [pinned, pinned]


def test_a_pinned_transaction_whose_connection_is_lost_is_not_retried(db):
    """What lived on a lost connection is gone with it: the error propagates."""
    ran_on: list[sa.Connection] = []

    def body(tx: bmdb.Tx) -> None:
        ran_on.append(tx.conn)
        raise sa.exc.OperationalError("SELECT 1", {}, Exception("server closed the connection"),
                                      connection_invalidated=True)

    with db.engine.connect() as pinned, pytest.raises(bmdb.Unavailable) as raised:
        run_transaction(db.engine, body, connection=pinned)
    assert ran_on == [pinned]
    assert isinstance(raised.value.__cause__, sa.exc.OperationalError)
