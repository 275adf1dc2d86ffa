"""Update against the simulator (real HTTP) and a real BMDB (PostgreSQL and SQLite)."""

# Fixtures are imported from tests.simulator_fixtures and used as arguments:
# ruff: noqa: F401, F811

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa

import bmdb
from shepherd.providers.base import ProviderMachine, TransientExhausted, register_provided
from shepherd.providers.equinix import EquinixProvider
from shepherd.simulator import Simulator
from shepherd.workflows.provisioner import ProvisionerSettings, reconcile
from shepherd.workflows.updater import UpdaterSettings, update
from tests.simulator_fixtures import client, provider, simulator, ssh_key

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
    p = bmdb.schema.provided
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
        lambda tx: bmdb.queries.provided_by_provider_id(tx, provider.name))[fleet[0]]
    activate(simulator, fleet[0])

    class DeletesDuringListing:
        """An operator deletes the machine between our BMDB read and the listing."""

        name = provider.name

        def list_machines(self) -> list[ProviderMachine]:
            session.transact(lambda tx: bmdb.tags.delete_machine(tx, machine_id))
            return provider.list_machines()

    result = update(session, DeletesDuringListing())  # type: ignore[arg-type]
    assert result.updated == 0
    assert fleet[0] not in tags(session)
    assert not session.transact(lambda tx: bmdb.queries.machine_exists(tx, machine_id))


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
    with db.start_session("other", interval=2) as other, \
            bmdb.singletons.hold(other, f"update:{provider.name}"):
        assert update(session, provider).busy
    assert update(session, provider).updated == 1


def test_settings_refuse_nonsense():
    with pytest.raises(ValueError):
        UpdaterSettings(batch_size=0)
