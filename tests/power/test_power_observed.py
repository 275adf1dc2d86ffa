"""The power states Shepherd observed and set, recorded in the BMDB for the web view
(``bmdb.power_states``, ``shepherd.power.recorded``), the page reads beside them
(``bmdb.glances``), and the simulator's machines named as the simulator's.

Real parts: the BMDB on PostgreSQL and SQLite, the simulator's Equinix API over
loopback, the power controls ``shepherd.runtime`` builds for Recovery and
``shepherd power``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

import bmdb
from shepherd import metrics, runtime
from shepherd.config import Settings
from shepherd.power import (
    ExclusivePower,
    IntentNotRecorded,
    PowerAction,
    PowerRecorder,
    PowerState,
    ProviderPower,
    singleton_name,
)
from shepherd.providers.equinix import EquinixProvider
from shepherd.simulator import Simulator
from tests.support.bmdb_helpers import seed_provided

pytestmark = pytest.mark.timeout(120)
BMC = "redfish http://10.0.0.9 system /redfish/v1/Systems/1"


def test_readings_and_actions_are_recorded_apart(db: bmdb.BMDB) -> None:
    with db.start_session("test") as session:
        (machine,) = seed_provided(session, 1)
    assert db.read(lambda tx: bmdb.power_of(tx, machine)) is None
    assert db.read(lambda tx: bmdb.record_power_observed(tx, machine, "Unknown", BMC)
                   ) is False
    assert db.read(lambda tx: bmdb.record_power_action(
        tx, machine, "power_off", BMC)) is True
    asked = db.read(lambda tx: bmdb.power_of(tx, machine))
    assert asked is not None and (asked.state, asked.action, asked.via) == (
        None, "power_off", BMC)
    assert db.read(lambda tx: bmdb.record_power_observed(tx, machine, "Off", BMC))
    seen = db.read(lambda tx: bmdb.power_of(tx, machine))
    assert seen is not None and (seen.state, seen.action) == ("Off", "power_off")
    assert seen.observed_at is not None and asked.acted_at is not None
    assert seen.observed_at >= asked.acted_at and seen.acted_at == asked.acted_at
    nobody = uuid.uuid4()  # gone from the BMDB: nothing recorded, nothing raised
    assert db.read(lambda tx: bmdb.record_power_observed(tx, nobody, "On", BMC)
                   ) is False
    assert db.read(lambda tx: bmdb.record_power_action(tx, nobody, "power_on", BMC)
                   ) is False
    assert db.read(lambda tx: bmdb.power_states.of_machines(tx, [machine, nobody])).keys() \
        == {machine}


def test_a_page_reads_hostnames_whatever_the_reports_hold(db: bmdb.BMDB) -> None:
    """The hostname is the column written with the report (``tags.report_hostname``,
    whose rules ``tests/bmdb/test_tags.py`` checks), so reports that are arrays,
    scalars, or (SQLite checks nothing) not JSON at all give none, and the page's
    read never looks into them."""
    with db.start_session("test") as session:
        machines = seed_provided(session, 6)
    named, listed, scalar, bare, broken, unsafe = machines
    h = bmdb._schema.hardware_report

    def store(tx: bmdb.Tx) -> None:
        bmdb.set_hardware_report(tx, named, {"hostname": "<b>rack1-u07</b>", "cpu": {}})
        # Escapes PostgreSQL's json type accepts but its operators refuse: the
        # hostname beside them is still read, from its column.
        bmdb.set_hardware_report(tx, unsafe, {"s": "\ud800", "n": "\u0000", "hostname": "x"})
        for machine, report in ((listed, ["hostname", "x"]), (scalar, "hostname")):
            tx.execute(sa.insert(h).values(machine_id=machine, reported_at=tx.now,
                                           report=report))
        if tx.dialect == "sqlite":  # text no JSON parser accepts
            tx.execute(sa.insert(h).values(machine_id=broken, reported_at=tx.now, report={}))
            tx.execute(sa.text("UPDATE hardware_report SET report = 'not {json' "
                               "WHERE machine_id = :m"), {"m": broken.hex})

    db.read(store)
    seen = db.read(lambda tx: bmdb.glances(tx, machines))
    assert seen.keys() == set(machines)
    assert seen[named].hostname == "<b>rack1-u07</b>" and seen[unsafe].hostname == "x"
    assert [seen[m].hostname for m in (listed, scalar, bare, broken)] == [None] * 4
    assert seen[named].power is None and seen[named].last_heartbeat_at is None


def running_machine(provider: EquinixProvider, simulator: Simulator,
                    session: bmdb.Session) -> tuple[uuid.UUID, str]:
    """A running device of the simulator, registered in the BMDB as its provider's."""
    created = provider.create_machine(provider.list_capacity()[0])
    simulator.wait_for_state(created.provider_id, "active", timeout=10)

    def register(tx: bmdb.Tx) -> uuid.UUID:
        machine = bmdb.create_machine(tx)
        bmdb.upsert_provided(tx, machine, provider=provider.name,
                                  provider_id=created.provider_id, provider_status="Running")
        return machine

    return session.transact(register), created.provider_id


def simulator_settings() -> Settings:
    return dataclasses.replace(Settings(), provider="simulator")


def test_the_power_recovery_and_shepherd_power_use_records_what_it_reads_and_asks(
        db: bmdb.BMDB, provider: EquinixProvider, simulator: Simulator) -> None:
    with db.start_session("worker") as session:
        machine, device = running_machine(provider, simulator, session)
        listed = provider.get_machine(device)
        power = runtime.power_for(simulator_settings(), provider, session, listed)
        assert isinstance(power, ProviderPower)
        assert power.power_state() is PowerState.ON
        seen = session.transact(lambda tx: bmdb.power_of(tx, machine))
        assert seen is not None and (seen.state, seen.action) == ("On", None)
        assert seen.via == f"provider {provider.name} device {device}"
        power.act(PowerAction.FORCE_RESTART)
        assert simulator.devices[device].reboots == 1
        asked = session.transact(lambda tx: bmdb.power_of(tx, machine))
        assert asked is not None and (asked.state, asked.action) == ("On", "force_restart")
        rebooting = power.power_state()  # Equinix shows a rebooting device as stopped
        assert rebooting in (PowerState.OFF, PowerState.TRANSITIONING)
        during = session.transact(lambda tx: bmdb.power_of(tx, machine))
        assert during is not None and during.state == rebooting.value


def test_a_bmc_behind_the_fleet_lock_records_once_released(
        db: bmdb.BMDB, provider: EquinixProvider, simulator: Simulator) -> None:
    """``ExclusivePower`` (every BMC's wrapper) records too, after the BMC's lock is
    released: the record is a transaction of its own, never inside the BMC's turn."""
    with db.start_session("worker") as session, db.start_session("other") as other:
        machine, device = running_machine(provider, simulator, session)
        recorder = _SeesTheLock(session, machine, other, "lock")
        power = ExclusivePower(ProviderPower(provider, device), session, "lock",
                               recorder=recorder)  # type: ignore[arg-type]
        assert recorder._held() is False
        with power.held():  # the probe does see the lock when it is held
            assert recorder._held() is True
        assert power.power_state() is PowerState.ON
        power.act(PowerAction.GRACEFUL_RESTART)
        # The reading, the action's intent (before the BMC is taken), its outcome.
        assert recorder.held_while_recording == [False, False, False]
        seen = session.transact(lambda tx: bmdb.power_of(tx, machine))
        assert seen is not None and (seen.state, seen.action) == ("On", "graceful_restart")


class _SeesTheLock:
    """A real recorder that also notes whether the BMC's singleton was held meanwhile,
    asked through another session (``probe``), as another worker would find it."""

    def __init__(self, session: bmdb.Session, machine: uuid.UUID, probe: bmdb.Session,
                 lock: str) -> None:
        self.inner = PowerRecorder(session, lambda tx: machine)
        self.probe = probe
        self.singleton = singleton_name(lock)
        self.held_while_recording: list[bool] = []

    def _held(self) -> bool:
        def try_and_release(tx: bmdb.Tx) -> bool:
            if bmdb.try_acquire_singleton(tx, self.singleton):
                bmdb.release_singleton(tx, self.singleton)
                return False
            return True

        return self.probe.transact(try_and_release)

    def observed(self, state: PowerState, via: str) -> None:
        self.held_while_recording.append(self._held())
        self.inner.observed(state, via)

    def asking(self, action: PowerAction, via: str) -> None:
        self.held_while_recording.append(self._held())
        self.inner.asking(action, via)

    def acted(self, action: PowerAction, via: str) -> None:
        self.held_while_recording.append(self._held())
        self.inner.acted(action, via)

    def failed(self, action: PowerAction, via: str) -> None:
        self.held_while_recording.append(self._held())
        self.inner.failed(action, via)


def test_a_failed_record_fails_no_reading_but_stops_an_action(
        db: bmdb.BMDB, provider: EquinixProvider, simulator: Simulator,
        caplog: pytest.LogCaptureFixture) -> None:
    """A reading is worth having unrecorded; a reset is not made without its intent
    written first, so that no reset ever goes missing from history."""
    with db.start_session("worker") as session:
        machine, device = running_machine(provider, simulator, session)
        listed = provider.get_machine(device)
    # The session is closed: every record fails; the reading does not, the reboot is
    # not asked at all.
    power = runtime.power_for(simulator_settings(), provider, session, listed)
    assert power is not None
    with caplog.at_level(logging.WARNING, "shepherd.power.recorded"):
        assert power.power_state() is PowerState.ON
        with pytest.raises(IntentNotRecorded, match="force_restart not asked: its intent "
                                                    "could not be recorded"):
            power.act(PowerAction.FORCE_RESTART)
    assert simulator.devices[device].reboots == 0
    assert len([r for r in caplog.records if "could not record" in r.getMessage()]) == 1
    assert db.read(lambda tx: bmdb.power_of(tx, machine)) is None


def test_an_action_is_recorded_as_asked_before_the_call_and_answered_after(
        db: bmdb.BMDB) -> None:
    """Intent, then outcome: a worker killed between the two leaves the action asked,
    in the power state and in history, and it counts as possibly under way for one
    rung's timeout unless it failed."""
    with db.start_session("test") as session:
        (machine,) = seed_provided(session, 1)
    assert db.read(lambda tx: bmdb.record_power_asked(tx, machine, "force_restart", BMC))
    asked = db.read(lambda tx: bmdb.power_of(tx, machine))
    assert asked is not None and (asked.action, asked.outcome) == ("force_restart", "asked")
    [row] = [h for h in db.read(lambda tx: bmdb.machine_history(tx, machine))
             if h["process"] == "Power"]
    assert (row["event"], row["cause"]) == ("Asked", f"force_restart of {BMC}")
    assert asked.acted_at is not None
    assert asked.may_be_under_way(asked.acted_at - dt.timedelta(seconds=1))
    assert not asked.may_be_under_way(asked.acted_at)  # asked before the window
    db.read(lambda tx: bmdb.record_power_action(tx, machine, "force_restart", BMC))
    done = db.read(lambda tx: bmdb.power_of(tx, machine))
    assert done is not None and done.outcome == "acknowledged"
    assert done.may_be_under_way(asked.acted_at - dt.timedelta(seconds=1))
    db.read(lambda tx: bmdb.record_power_action(tx, machine, "power_off", BMC, "failed"))
    failed = db.read(lambda tx: bmdb.power_of(tx, machine))
    assert failed is not None and failed.outcome == "failed"
    assert not failed.may_be_under_way(asked.acted_at - dt.timedelta(seconds=1))


def test_the_simulator_names_its_machines_as_the_simulators(
        simulator: Simulator, tmp_path: Path) -> None:
    """``build_provider`` names the provider as configured: machines it registers are
    the simulator's (``Provided.provider``), not Equinix's, though it speaks that API."""
    settings = dataclasses.replace(
        Settings(), provider="simulator", provider_url=simulator.base_url,
        provider_project=simulator.project_id, provider_token=simulator.config.token,
        provider_min_interval=0.0, ssh_key_path=tmp_path / "id_ed25519",
        provider_ssh_port=simulator.ssh_port)
    calls = metrics.PROVIDER_CALLS.labels("simulator", "GET /projects/{id}/devices", "ok")
    before = calls._value.get()
    built = runtime.build_provider(settings)
    assert built.name == "simulator"
    list(built.list_machines())
    assert calls._value.get() == before + 1  # its API calls are counted as its own too
    assert runtime.build_provider(dataclasses.replace(settings, provider="equinix")
                                  ).name == "equinix"
