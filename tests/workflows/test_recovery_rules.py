"""Recovery's rules on a real BMDB: holds keep machines out of every backlog and out of
the guard's share, a small rack still recovers, quarantine comes after N exhausted
ladders in a row (and only then), and the ladder and BMC settings reach the objects
the workers build."""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid

import pytest

import bmdb
from shepherd import runtime
from shepherd.bmc import BmcSpec
from shepherd.config import Settings, SettingsError
from shepherd.operations import explain
from shepherd.power import ExclusivePower
from shepherd.providers.base import ProviderMachine
from shepherd.workflows import guard
from tests.support.bmdb_helpers import seed_provided

NOW_SILENT = bmdb.Thresholds(first_heartbeat=60, heartbeat=60)


def silent_agents(session: bmdb.Session, count: int) -> list[uuid.UUID]:
    """``count`` machines whose agents started two hours ago and were never heard."""
    machines = seed_provided(session, count)

    def body(tx: bmdb.Tx) -> None:
        for machine in machines:
            bmdb.set_agent_started(tx, machine, b"k" * 32,
                                        started_at=tx.now - dt.timedelta(hours=2))

    session.transact(body)
    return machines


def backlog_ids(session: bmdb.Session, process: bmdb.Process) -> set[uuid.UUID]:
    backlog = bmdb.retriever(process, NOW_SILENT)
    return set(session.transact(lambda tx: list(tx.execute(backlog(tx)).scalars())))


def test_held_machines_are_in_no_backlog_and_out_of_the_share(session: bmdb.Session) -> None:
    silent = silent_agents(session, 3)
    waiting = seed_provided(session, 2)
    assert backlog_ids(session, bmdb.Process.RECOVERY) == set(silent)
    assert backlog_ids(session, bmdb.Process.AGENT_START) == set(waiting)

    def hold(tx: bmdb.Tx) -> None:
        assert bmdb.put_hold(tx, silent[0], bmdb.MAINTENANCE, "disk swap", "alice")
        assert bmdb.put_hold(tx, waiting[0], bmdb.QUARANTINE, "test", "bob")
        assert not bmdb.put_hold(tx, silent[0], bmdb.MAINTENANCE, "again", "alice")

    session.transact(hold)
    assert backlog_ids(session, bmdb.Process.RECOVERY) == set(silent[1:])
    assert backlog_ids(session, bmdb.Process.AGENT_START) == set(waiting[1:])
    started, silent_count = session.transact(lambda tx: guard.silent_counts(tx, NOW_SILENT))
    assert (started, silent_count) == (2, 2)
    # A claim by name is refused too, with the backlog's reason.
    with pytest.raises(bmdb.NotInBacklog):
        session.claim_machine(bmdb.Process.RECOVERY, silent[0])
    counts = session.transact(lambda tx: bmdb.held_counts(tx))
    assert counts == {"maintenance": 1, "quarantine": 1, "host-key": 0,
                      "bmc-mismatch": 0}

    assert session.transact(lambda tx: bmdb.lift_hold(tx, silent[0], "maintenance", "alice"))
    assert silent[0] in backlog_ids(session, bmdb.Process.RECOVERY)
    history = session.transact(lambda tx: bmdb.machine_history(tx, silent[0]))
    assert [(h["process"], h["event"], h["cause"]) for h in history] == [
        ("Maintenance", "Released", "by alice"),
        ("Maintenance", "Held", "by alice: disk swap"),
    ]


def test_one_silent_machine_of_a_one_machine_rack_is_recovered(session: bmdb.Session) -> None:
    """1 of 1 silent is 100 %, but within the default minimum of silent machines."""
    silent_agents(session, 1)
    decision = session.transact(
        lambda tx: guard.decide(tx, NOW_SILENT, guard.GuardLimits(), None))
    assert decision.paused is None and (decision.started, decision.silent) == (1, 1)
    assert Settings.from_env({}).recovery_min_silent == 1
    silent_agents(session, 1)
    decision = session.transact(
        lambda tx: guard.decide(tx, NOW_SILENT, guard.GuardLimits(), None))
    assert decision.causes == (guard.SILENT_SHARE,)


def exhaust(session: bmdb.Session, machine: uuid.UUID, limit: int,
            cause: str = bmdb.LADDER_EXHAUSTED + ": test") -> bool:
    """One Recovery of ``machine`` that fails with ``cause``; whether it quarantined."""
    work = session.claim_machine(bmdb.Process.RECOVERY, machine)
    quarantined: list[bool] = []
    work.fail(cause, bmdb.Backoff(initial=1),
              then=lambda tx: quarantined.append(
                  bmdb.quarantine_if_due(tx, machine, limit, "test")))
    session.transact(lambda tx: bmdb.clear_backoff(tx, machine, bmdb.Process.RECOVERY))
    return quarantined[-1]


def test_quarantine_after_n_exhausted_ladders_in_a_row(session: bmdb.Session) -> None:
    [machine] = silent_agents(session, 1)
    assert not exhaust(session, machine, 3)
    assert not exhaust(session, machine, 3)
    # Another kind of failure breaks the streak.
    assert not exhaust(session, machine, 3, cause="bmc: BmcUnreachable: test")
    assert not exhaust(session, machine, 3)
    assert not exhaust(session, machine, 3)
    assert machine in backlog_ids(session, bmdb.Process.RECOVERY)
    assert exhaust(session, machine, 3)
    assert machine not in backlog_ids(session, bmdb.Process.RECOVERY)
    [held] = session.transact(lambda tx: bmdb.holds_of(tx, machine))
    assert held.kind == "quarantine" and "3 times in a row" in held.reason
    # Let out by an operator: a fresh start, not quarantined again at the next failure.
    assert session.transact(lambda tx: bmdb.lift_hold(tx, machine, "quarantine", "carol"))
    assert not exhaust(session, machine, 3)
    assert not exhaust(session, machine, 3)
    assert exhaust(session, machine, 3)


def test_a_machine_gone_from_the_provider_is_left_alone(session: bmdb.Session) -> None:
    gone, present = silent_agents(session, 2)
    session.transact(lambda tx: bmdb.set_provider_status(
        tx, [gone], bmdb.ProviderStatus.MISSING))
    assert backlog_ids(session, bmdb.Process.RECOVERY) == {present}
    with pytest.raises(bmdb.NotInBacklog):
        session.claim_machine(bmdb.Process.RECOVERY, gone)
    # explain says so, not "heartbeat stale".
    explained = session.transact(lambda tx: explain(tx, gone, NOW_SILENT))
    recovery = next(p for p in explained.processes if p.process == bmdb.Process.RECOVERY)
    assert not recovery.in_backlog and recovery.backlog.startswith("gone (no longer listed")


def test_ladder_and_bmc_settings_reach_what_workers_build(session: bmdb.Session) -> None:
    settings = Settings.from_env({
        "SHEPHERD_RUNG_TIMEOUT": "17", "SHEPHERD_RUNG_POLL_INTERVAL": "0.3",
        "SHEPHERD_BOOT_WAIT": "23", "SHEPHERD_QUARANTINE_AFTER": "5",
        "SHEPHERD_BMC_TIMEOUT": "4", "SHEPHERD_BMC_ATTEMPTS": "6",
        "SHEPHERD_BMC_LOCK_WAIT": "9", "SHEPHERD_BMC_CALLS_MAX": "7",
        "SHEPHERD_PROVIDER": "static",
    })
    recovery = runtime.recoverer_settings(settings)
    assert (recovery.ladder.rung_timeout, recovery.ladder.poll_interval,
            recovery.ladder.boot_wait, recovery.quarantine_after) == (17, 0.3, 23, 5)
    bmc = BmcSpec(driver="redfish", address="http://127.0.0.1:9", username="admin",
                  password_file="/nonexistent")
    machine = ProviderMachine("m1", "127.0.0.1", 22, None, None,
                              bmdb.ProviderStatus.RUNNING, False, bmc=bmc)
    power = runtime.power_for(settings, None, session, machine)  # type: ignore[arg-type]
    assert isinstance(power, ExclusivePower) and power.wait == 9
    assert len(power.call_slots) == 7
    assert (power.inner.timeout, power.inner.attempts) == (4, 6)  # type: ignore[attr-defined]
    without_bmc = ProviderMachine("m2", "127.0.0.1", 22, None, None,
                                  bmdb.ProviderStatus.RUNNING, False)
    assert runtime.power_for(settings, None, session, without_bmc) is None  # type: ignore[arg-type]
    # The whole ladder fits in a machine task's time limit.
    assert settings.machine_task_soft_time_limit > 4 * 17 + 23 + 4 * (9 + 4 * 6)


def test_the_sync_settings_reach_the_sync_and_beat() -> None:
    """The power and health sync's budget from the environment: the worker's sync
    settings, its drivers' bounds, and beat's schedule (no entry when it is off)."""
    from celeryconfig import beat_schedule

    settings = Settings.from_env({
        "SHEPHERD_BMC_SYNC_INTERVAL": "45", "SHEPHERD_BMC_SYNC_TICK": "3",
        "SHEPHERD_BMC_CALLS_MAX": "7", "SHEPHERD_BMC_CALLS_RESERVED": "2",
        "SHEPHERD_BMC_SLOW": "1.5", "SHEPHERD_HEARTBEAT_TIMEOUT": "90",
        "SHEPHERD_BMC_TIMEOUT": "4", "SHEPHERD_BMC_ATTEMPTS": "6",
        "SHEPHERD_PROVIDER": "static",
    })
    synced = runtime.bmc_sync_settings(settings)
    assert (synced.interval, synced.tick, synced.calls_cap, synced.reserved, synced.slow,
            synced.heartbeat_timeout, synced.threads) == (45, 3, 7, 2, 1.5, 90, 5)
    driver = runtime.bmc_driver(settings)(BmcSpec(
        driver="redfish", address="http://127.0.0.1:9", username="admin",
        password_file="/nonexistent"))
    assert (driver.timeout, driver.attempts) == (4, 6)
    assert beat_schedule(settings)["bmc-sync"]["schedule"] == 3
    off = dataclasses.replace(settings, bmc_sync_interval=0.0)
    assert "bmc-sync" not in beat_schedule(off)
    with pytest.raises(SettingsError, match="SHEPHERD_BMC_CALLS_RESERVED=7 must leave"):
        runtime.check_settings(dataclasses.replace(settings, bmc_calls_reserved=7,
                                                   static_inventory="x.toml"))


def test_a_ladder_longer_than_the_brokers_patience_is_refused() -> None:
    """Redis hands an unacknowledged message to another worker after the visibility
    timeout: a Recovery that may take longer would be run twice."""
    settings = Settings.from_env({"SHEPHERD_RUNG_TIMEOUT": "900", "SHEPHERD_PROVIDER": "static",
                                  "SHEPHERD_STATIC_INVENTORY": "x.toml"})
    with pytest.raises(SettingsError, match="SHEPHERD_VISIBILITY_TIMEOUT=3600 must exceed"):
        runtime.check_settings(settings)
    runtime.check_settings(dataclasses.replace(settings, visibility_timeout=7200.0))
