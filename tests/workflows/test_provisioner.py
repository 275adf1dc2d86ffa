"""Reconcile against the simulator (real HTTP) and a real BMDB (PostgreSQL and SQLite)."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa

import bmdb
from shepherd.providers.base import (
    Capacity,
    ConfigError,
    ProviderMachine,
    TransientExhausted,
    register_provided,
)
from shepherd.providers.equinix import (
    ClientConfig,
    EquinixClient,
    EquinixProvider,
    ProviderConfig,
)
from shepherd.simulator import Simulator
from shepherd.workflows import provisioner
from shepherd.workflows.provisioner import (
    FleetMismatch,
    ProvisionerSettings,
    ReconcileResult,
    reconcile,
)
from tests.support.simulator_fixtures import fast_client

pytestmark = pytest.mark.timeout(60)

RESERVATIONS = 6  # what the simulator fixture holds


def settings(**overrides: Any) -> ProvisionerSettings:
    values: dict[str, Any] = {"max_machines": 100, "chunk_size": 3, "creation_rate": 0.0}
    values.update(overrides)
    return ProvisionerSettings(**values)


def known(session: bmdb.Session, provider: EquinixProvider) -> dict[str, Any]:
    return session.transact(lambda tx: bmdb.provided_by_provider_id(tx, provider.name))


def ours(sim: Simulator) -> list[Any]:
    return [d for d in sim.devices.values() if d.created_by == "api"]


def stray_device(sim: Simulator, hostname: str = "shepherd-test-stray") -> str:
    """A device with our prefix that the BMDB never heard of (made behind our back)."""
    reservation = sim.state.project_reservations()[-1]
    return sim.create_device({"metro": reservation.metro, "plan": reservation.plan,
                              "operating_system": "ubuntu_22_04", "hostname": hostname,
                              "hardware_reservation_id": reservation.id}).id


def ghost(session: bmdb.Session, provider: EquinixProvider, provider_id: str = "ghost") -> None:
    """A BMDB machine the provider does not list."""
    machine = ProviderMachine(provider_id, "192.0.2.1", 22, "sv15", None,
                              bmdb.ProviderStatus.RUNNING, False)
    session.transact(lambda tx: register_provided(tx, provider.name, machine))


def assert_json(result: ReconcileResult) -> dict[str, Any]:
    return json.loads(json.dumps(result.to_json()))


# -- creation ---------------------------------------------------------------------


def test_chunks_until_every_reservation_is_provided(session, provider, simulator):
    first = reconcile(session, provider, settings())
    assert len(first.created) == 3 and not first.failed
    assert (first.machines_before, first.machines_after) == (0, 3)
    second = reconcile(session, provider, settings())
    assert len(second.created) == 3 and second.machines_before == 3
    third = reconcile(session, provider, settings())
    assert third.created == () and third.machines_after == RESERVATIONS
    devices = ours(simulator)
    assert len(devices) == RESERVATIONS
    assert set(known(session, provider)) == {d.id for d in devices}
    assert len({d.reservation_id for d in devices}) == RESERVATIONS
    report = assert_json(second)
    assert report["created"] == list(second.created) and report["failed"] == {}


def test_registers_what_the_provider_reports(session, provider, simulator):
    result = reconcile(session, provider, settings(chunk_size=1))
    (device_id,) = result.created
    device = simulator.devices[device_id]
    machine_id = known(session, provider)[device_id]
    tag = session.transact(lambda tx: bmdb.machine_tags(tx, machine_id))["Provided"]
    assert tag["reservation_id"] == device.reservation_id
    assert tag["address"] == device.address and tag["location"] == device.facility
    assert tag["provider_status"] == bmdb.ProviderStatus.PROVISIONING


def test_max_machines_counts_existing_machines(session, provider, simulator):
    limit = settings(max_machines=4)
    assert len(reconcile(session, provider, limit).created) == 3
    assert len(reconcile(session, provider, limit).created) == 1
    last = reconcile(session, provider, limit)
    assert last.created == () and (last.machines_before, last.max_machines) == (4, 4)
    assert len(ours(simulator)) == 4
    assert reconcile(session, provider, settings(max_machines=0)).created == ()


def test_creation_rate_spaces_creations(session, provider):
    started = time.monotonic()
    result = reconcile(session, provider, settings(creation_rate=5.0))
    elapsed = time.monotonic() - started
    assert len(result.created) == 3
    assert 0.38 <= elapsed < 20, elapsed  # two gaps of 0.2 s between three creations


# -- the fleets must agree ----------------------------------------------------------


def test_provider_only_machine_stops_the_run(session, provider, simulator, caplog):
    stray = stray_device(simulator)
    with caplog.at_level(logging.ERROR), pytest.raises(FleetMismatch) as raised:
        reconcile(session, provider, settings())
    assert (raised.value.provider_only, raised.value.bmdb_only) == ([stray], [])
    assert any(stray in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
    assert len(simulator.devices) == 1 and known(session, provider) == {}


def _interrupted_creation(session, provider, simulator, record: bool = True) -> str:
    """What a creator killed between the provider's answer and its commit leaves: the
    intent (committed first) and the device carrying its witness, nothing registered."""
    capacity = provider.list_capacity()[0]
    if record:
        session.transact(lambda tx: bmdb.record_intent(
            tx, provider.name, capacity.reservation_id, capacity.request_id))
    device = provider.client.create_device(
        capacity.reservation_id,
        {"metro": capacity.details["metro"], "plan": capacity.plan,
         "operating_system": "ubuntu_22_04",
         "hostname": f"shepherd-test-{capacity.reservation_id[:8]}"},
        "shepherd-witness:" + capacity.request_id)
    return device["id"]


def test_an_interrupted_creation_is_registered_not_a_mismatch(session, provider, simulator,
                                                               caplog):
    orphan = _interrupted_creation(session, provider, simulator)
    with caplog.at_level(logging.WARNING):
        result = reconcile(session, provider, settings())
    assert result.recovered == 1 and orphan in known(session, provider)
    assert any("interrupted" in r.getMessage() and orphan in r.getMessage()
               for r in caplog.records)
    assert session.transact(lambda tx: bmdb.pending_intents(tx, provider.name)) == {}
    assert len(result.created) == 3 and len(ours(simulator)) == 4  # and it went on


def test_a_witness_without_an_intent_is_still_a_stranger(session, provider, simulator):
    stray = _interrupted_creation(session, provider, simulator, record=False)
    with pytest.raises(FleetMismatch) as raised:
        reconcile(session, provider, settings())
    assert raised.value.provider_only == [stray] and known(session, provider) == {}


def test_intents_are_recorded_first_and_forgotten_with_the_outcome(session, provider,
                                                                    simulator):
    seen: list[dict[str, str]] = []

    class Watching:
        """The provider, noting the pending intents at the moment it is asked."""

        name = provider.name

        def __getattr__(self, item: str) -> Any:
            return getattr(provider, item)

        def create_machine(self, capacity):
            seen.append(session.transact(
                lambda tx: bmdb.pending_intents(tx, provider.name)))
            return provider.create_machine(capacity)

    simulator.faults.fail_next(1, 422, method="POST")  # one definite failure
    result = reconcile(session, Watching(), settings())
    assert len(result.created) == 2 and len(result.failed) == 1
    assert [len(pending) for pending in seen] == [1, 1, 1]  # each one's own, committed
    assert session.transact(lambda tx: bmdb.pending_intents(tx, provider.name)) == {}


class Killed(BaseException):
    """The process dying: not an error the provisioner could handle."""


def test_a_crash_between_create_and_register_is_registered_next_run(
        session, provider, simulator, monkeypatch):
    """The device was made, the process died before its registration transaction: the
    committed intent makes the next run register it instead of stopping on a mismatch."""

    def dies(*args: Any, **kwargs: Any) -> None:
        raise Killed

    monkeypatch.setattr(provisioner, "register_created", dies)
    with pytest.raises(Killed):
        reconcile(session, provider, settings())
    (orphan,) = [d.id for d in ours(simulator)]
    assert known(session, provider) == {}
    pending = session.transact(lambda tx: bmdb.pending_intents(tx, provider.name))
    assert list(pending.values()) == [simulator.devices[orphan].reservation_id]

    monkeypatch.undo()
    result = reconcile(session, provider, settings())
    assert result.recovered == 1 and orphan in known(session, provider)
    assert session.transact(lambda tx: bmdb.pending_intents(tx, provider.name)) == {}
    assert len(result.created) == 3 and len(ours(simulator)) == 4
    assert len({d.reservation_id for d in ours(simulator)}) == 4  # nothing made twice


class TransactionWatch:
    """Which threads have a BMDB transaction open, from the engine's own events."""

    EVENTS = {"begin": True, "commit": False, "rollback": False}

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.open: set[int] = set()
        self._listeners = {name: self._listener(opens) for name, opens in self.EVENTS.items()}

    def _listener(self, opens: bool) -> Callable[[Any], None]:
        def note(conn: Any) -> None:
            (self.open.add if opens else self.open.discard)(threading.get_ident())

        return note

    def __enter__(self) -> TransactionWatch:
        for name, listener in self._listeners.items():
            sa.event.listen(self.engine, name, listener)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, listener in self._listeners.items():
            sa.event.remove(self.engine, name, listener)

    def in_this_thread(self) -> bool:
        return threading.get_ident() in self.open


def sqlite_writable(db: bmdb.BMDB) -> bool | None:
    """Whether another connection can take SQLite's write lock now (None on PostgreSQL):
    what an HTTP call inside a transaction body used to block for its whole length."""
    if db.engine.dialect.name != "sqlite":
        return None
    path = db.engine.url.database
    assert path is not None  # sqlite_url names a file
    probe = sqlite3.connect(path, timeout=2.0, isolation_level=None)
    try:
        probe.execute("BEGIN IMMEDIATE")
        probe.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        probe.close()


def test_no_bmdb_transaction_is_open_during_any_provider_call(db, session, provider,
                                                               simulator):
    """Listings, the interrupted creation's registration, creates: at every HTTP
    exchange the provider makes, this thread has no transaction open and (on SQLite)
    another connection can write."""
    calls: list[tuple[str, str, bool, bool | None]] = []

    @contextlib.contextmanager
    def probe(method: str, path: str) -> Iterator[Any]:
        calls.append((method, path, watch.in_this_thread(), sqlite_writable(db)))
        yield SimpleNamespace(status=None)

    watched = EquinixProvider(fast_client(simulator, observer=probe), provider.config)
    watched.ssh_key_ids = provider.ssh_key_ids
    _interrupted_creation(session, provider, simulator)
    with TransactionWatch(db.engine) as watch:
        assert session.transact(lambda tx: watch.in_this_thread())  # the watch works
        result = reconcile(session, watched, settings())
    assert result.recovered == 1 and len(result.created) == 3
    creates = [c for c in calls if c[0] == "POST"]
    assert len(creates) == 3 and len(calls) > 3
    held = [c for c in calls if c[2] or c[3] is False]
    assert held == [], held


def test_an_intent_whose_device_never_came_is_dropped_after_a_day(session, provider):
    session.transact(lambda tx: bmdb.record_intent(tx, "equinix", "r-1", "w-1"))
    i = bmdb._schema.creation_intents
    assert session.transact(lambda tx: bmdb.pending_intents(tx, "equinix")) == {
        "w-1": "r-1"}
    session.transact(lambda tx: tx.execute(sa.update(i).values(
        created_at=tx.now - bmdb.INTENT_LIFETIME - dt.timedelta(seconds=1))))
    assert session.transact(lambda tx: bmdb.pending_intents(tx, "equinix")) == {}


def test_bmdb_only_machine_stops_the_run(session, provider, simulator):
    ghost(session, provider)
    with pytest.raises(FleetMismatch) as raised:
        reconcile(session, provider, settings())
    assert (raised.value.provider_only, raised.value.bmdb_only) == ([], ["ghost"])
    assert simulator.devices == {}


def test_assimilate_registers_provider_only_machines(session, provider, simulator):
    stray = stray_device(simulator)
    result = reconcile(session, provider, settings(assimilate=True))
    assert result.assimilated == 1 and len(result.created) == 3
    assert stray in known(session, provider)
    assert reconcile(session, provider, settings()).assimilated == 0  # in step now


def test_assimilate_still_stops_on_bmdb_only_machines(session, provider, simulator):
    stray = stray_device(simulator)
    ghost(session, provider)
    with pytest.raises(FleetMismatch) as raised:
        reconcile(session, provider, settings(assimilate=True))
    assert (raised.value.provider_only, raised.value.bmdb_only) == ([], ["ghost"])
    assert stray in known(session, provider)
    assert len(simulator.devices) == 1


def test_other_providers_machines_are_not_compared(session, provider, simulator):
    machine = ProviderMachine("rack-1", "192.0.2.9", 22, "fra1", None,
                              bmdb.ProviderStatus.RUNNING, False)
    session.transact(lambda tx: register_provided(tx, "static", machine))
    assert len(reconcile(session, provider, settings()).created) == 3


# -- failed capacity ----------------------------------------------------------------


class RacingProvider:
    """The real provider, but someone else grabs the first reservation right after we
    listed it, and the stale listing keeps offering it (a provider's listing lag)."""

    def __init__(self, real: EquinixProvider, sim: Simulator) -> None:
        self.real, self.sim = real, sim
        self.stolen: Capacity | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def list_capacity(self) -> list[Capacity]:
        capacity = self.real.list_capacity()
        if self.stolen is None:
            self.stolen = capacity[0]
            self.sim.create_foreign_device(self.stolen.reservation_id)
            return capacity
        return [self.stolen, *capacity]


def test_lost_race_cools_down_and_is_skipped(session, provider, simulator):
    racing = RacingProvider(provider, simulator)
    first = reconcile(session, racing, settings())
    assert racing.stolen is not None
    stolen = racing.stolen.reservation_id
    assert list(first.failed) == [stolen] and "RaceLost" in first.failed[stolen]
    assert len(first.created) == 2  # the failed attempt counts against the chunk
    cooling = session.transact(lambda tx: bmdb.cooling(tx, provider.name))
    assert "RaceLost" in cooling[stolen]
    second = reconcile(session, racing, settings())
    assert second.skipped_cooling == 1 and second.failed == {}
    reconcile(session, racing, settings())
    assert len(ours(simulator)) == RESERVATIONS - 1 and len(simulator.devices) == RESERVATIONS
    assert stolen not in {d.reservation_id for d in ours(simulator)}


def test_refused_creation_cools_down_and_the_run_goes_on(session, provider, simulator):
    simulator.faults.fail_next(1, 422, method="POST")
    first = reconcile(session, provider, settings())
    assert len(first.failed) == 1 and len(first.created) == 2
    (refused, cause), = first.failed.items()
    assert "PermanentError" in cause
    second = reconcile(session, provider, settings())
    assert second.skipped_cooling == 1 and refused not in second.failed
    reconcile(session, provider, settings())
    assert len(ours(simulator)) == RESERVATIONS - 1
    assert refused not in {d.reservation_id for d in ours(simulator)}


def test_zero_cooldown_retries_next_run(session, provider, simulator):
    simulator.faults.fail_next(1, 422, method="POST")
    first = reconcile(session, provider, settings(cooldown=0.0, chunk_size=1))
    assert len(first.failed) == 1
    second = reconcile(session, provider, settings(cooldown=0.0, chunk_size=1))
    assert second.skipped_cooling == 0 and len(second.created) == 1


# -- the provider is down -----------------------------------------------------------


def test_api_errors_propagate_and_nothing_is_written(session, provider, simulator):
    simulator.faults.set(api_error_rate=1.0)
    with pytest.raises(TransientExhausted):
        reconcile(session, provider, settings())
    assert known(session, provider) == {}
    assert session.transact(lambda tx: bmdb.cooling(tx, provider.name)) == {}
    assert simulator.devices == {}


def test_connection_refused_propagates(session, provider, simulator):
    simulator.stop()
    with pytest.raises(TransientExhausted):
        reconcile(session, provider, settings())
    assert known(session, provider) == {}


def test_outage_during_creation_stops_the_run(session, provider, simulator):
    simulator.faults.fail_next(100, 503, method="POST")
    result = reconcile(session, provider, settings())
    assert result.created == () and len(result.failed) == 1  # not the whole chunk
    assert "TransientExhausted" in next(iter(result.failed.values()))
    assert simulator.devices == {}
    # An outage says nothing about the reservation tried: it must not sit out an hour.
    assert session.transact(lambda tx: bmdb.cooling(tx, provider.name)) == {}
    simulator.faults.clear()
    assert len(reconcile(session, provider, settings()).created) > 0


# -- guards ---------------------------------------------------------------------


def test_one_reconcile_at_a_time_fleet_wide(db, session, provider, simulator):
    with db.start_session("other", interval=30) as other, \
            bmdb.hold_singleton(other, provisioner.RECONCILE_HOLD) as held:
        assert held
        result = reconcile(session, provider, settings())
    assert result.busy and result.created == () and simulator.devices == {}
    assert result.to_json() == {"skipped": "reconcile already running"}
    assert len(reconcile(session, provider, settings()).created) == 3


@pytest.mark.parametrize("bad", [
    {"max_machines": -1}, {"chunk_size": 0}, {"creation_rate": -1.0},
    {"creation_rate": float("inf")}, {"cooldown": float("nan")},
])
def test_settings_refuse_nonsense(bad):
    with pytest.raises(ValueError):
        settings(**bad)


@pytest.mark.parametrize("config", [
    {"device_prefix": "changeme-", "ssh_key_label": "shepherd"},
    {"device_prefix": "", "ssh_key_label": "shepherd"},
    {"device_prefix": "shepherd-", "ssh_key_label": "FIXME"},
    {"device_prefix": "shepherd-", "ssh_key_label": "placeholder"},
    {"device_prefix": "example-", "ssh_key_label": "shepherd"},
    {"device_prefix": "shepherd-", "ssh_key_label": "my-todo-key"},
])
def test_placeholder_prefix_and_label_are_refused_at_start(config):
    offline = EquinixClient(ClientConfig(token="t0ken", project_id="p-1",
                                         base_url="http://127.0.0.1:9/metal/v1"))
    with pytest.raises(ConfigError):
        EquinixProvider(offline, ProviderConfig(**config))


def test_a_real_name_that_contains_a_placeholder_word_is_accepted():
    offline = EquinixClient(ClientConfig(token="t0ken", project_id="p-1",
                                         base_url="http://127.0.0.1:9/metal/v1"))
    provider = EquinixProvider(offline, ProviderConfig(device_prefix="mastodon-",
                                                       ssh_key_label="shepherd-xxxl"))
    assert provider.config.device_prefix == "mastodon-"
