"""AgentStart and Recovery end to end on real parts: simulator devices over SSH, the real
agent, the real callback server, a real BMDB (PostgreSQL; the guard runs on both)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

import bmdb
from shepherd import operations
from shepherd.inventory.host_keys import key_line_fingerprint
from shepherd.power import ProviderPower, recorder_for
from shepherd.providers.base import ProviderMachine, register_provided
from shepherd.providers.equinix import EquinixProvider
from shepherd.server import RunningServer
from shepherd.simulator import Simulator
from shepherd.workflows import (
    PERMANENT_BACKOFF,
    InitializerSettings,
    RecovererSettings,
    initialize,
    recover,
    recovery_paused,
)
from shepherd.workflows.ladder import LadderSettings
from shepherd.workflows.recoverer import PowerFor
from tests.support.agent_fixtures import add_machine, tags_of
from tests.support.waiting import wait_until

THRESHOLDS = bmdb.Thresholds(first_heartbeat=3, heartbeat=1)


@pytest.fixture
def db(pg_url: str) -> Iterator[bmdb.BMDB]:
    """PostgreSQL only (these tests are end to end), with thresholds of seconds."""
    handle = bmdb.connect(pg_url, thresholds=THRESHOLDS)
    yield handle
    handle.close()


@pytest.fixture
def settings(ssh_key: Path, callback_server: RunningServer) -> InitializerSettings:
    return InitializerSettings(ssh_key_path=ssh_key, callback_url=callback_server.url,
                               connect_timeout=3.0, exec_timeout=15.0,
                               agent_args=("--interval", "0.3", "--max-backoff", "1"))


def provision(session: bmdb.Session, provider: EquinixProvider,
              simulator: Simulator) -> tuple[uuid.UUID, str]:
    """Create a device, wait until it is up, mark it Running: it joins the AgentStart backlog."""
    capacity = provider.list_capacity()[0]
    created = provider.create_machine(capacity)  # the provider call, outside any transaction
    simulator.wait_for_state(created.provider_id, "active", timeout=5)
    simulator.wait_for_ssh(created.provider_id, timeout=5)
    machine = provider.get_machine(created.provider_id)
    assert machine.status is bmdb.ProviderStatus.RUNNING
    machine_id = session.transact(lambda tx: register_provided(tx, provider.name, machine))
    return machine_id, machine.provider_id


def claim_one(session: bmdb.Session, process: bmdb.Process) -> bmdb.Work:
    claimed = session.claim_backlog(process, 1)
    assert len(claimed) == 1, f"expected one {process} claim, got {claimed}"
    return claimed[0]


def start_agent(session: bmdb.Session, provider: EquinixProvider, simulator: Simulator,
                settings: InitializerSettings, db: bmdb.BMDB) -> tuple[uuid.UUID, str]:
    machine_id, provider_id = provision(session, provider, simulator)
    work = claim_one(session, bmdb.Process.AGENT_START)
    assert work.machine_id == machine_id
    result = initialize(work, provider, settings)
    assert result.ok, result.cause
    wait_until(lambda: "AgentHeartbeat" in tags_of(db, machine_id), timeout=8, what="heartbeat")
    return machine_id, provider_id


def refuses(simulator: Simulator, provider_id: str) -> bool:
    """True once the device's SSH port refuses TCP (the fault applies on its next poll)."""
    endpoint = simulator.endpoint(provider_id)
    try:
        socket.create_connection((endpoint.address, endpoint.port), timeout=0.5).close()
    except ConnectionRefusedError:
        return True
    return False


def history(db: bmdb.BMDB, machine_id: uuid.UUID) -> list[dict]:
    return db.read(lambda tx: bmdb.machine_history(tx, machine_id))


def test_initialize_starts_an_agent_that_heartbeats(
        session: bmdb.Session, db: bmdb.BMDB, provider: EquinixProvider,
        simulator: Simulator, settings: InitializerSettings) -> None:
    machine_id, provider_id = start_agent(session, provider, simulator, settings, db)
    tags = tags_of(db, machine_id)
    assert len(tags["AgentStarted"]["public_key"]) == 32
    assert (simulator.sandbox(provider_id) / settings.agent_target).stat().st_mode & 0o777 == 0o755
    assert [h["event"] for h in history(db, machine_id)][:3] == ["Finished", "Pinned", "Started"]
    # Trust on first use: the host key the machine presented is now required.
    assert db.read(lambda tx: bmdb.pinned_host_key(tx, machine_id)) == \
        simulator.host_key_line(provider_id)
    assert session.held_work() == []
    assert session.claim_backlog(bmdb.Process.AGENT_START, 5) == []


def test_agent_start_reads_the_bmdb_once_before_acting(
        session: bmdb.Session, db: bmdb.BMDB, provider: EquinixProvider,
        simulator: Simulator, settings: InitializerSettings) -> None:
    """Issue 14: an AgentStart is two transactions (one read before the provider and
    SSH, then the finish); only the finish goes through the session (whose lock makes
    a COMMIT wait for the disk); the fleet's answer key is read once per process, not
    generated and written at every takeover."""
    start_agent(session, provider, simulator, settings, db)  # reads the answer key
    machine_id, _ = provision(session, provider, simulator)
    work = claim_one(session, bmdb.Process.AGENT_START)
    here = threading.get_ident()  # not the session's keep-alive thread
    transactions: list[str] = []

    def began(conn: object) -> None:
        if threading.get_ident() == here:
            transactions.append("BEGIN")

    def executed(conn: object, cursor: object, statement: str, *rest: object) -> None:
        if threading.get_ident() == here:
            transactions.append(statement)

    sa.event.listen(db.engine, "begin", began)
    sa.event.listen(db.engine, "before_cursor_execute", executed)
    try:
        assert initialize(work, provider, settings).ok
    finally:
        sa.event.remove(db.engine, "begin", began)
        sa.event.remove(db.engine, "before_cursor_execute", executed)
    assert transactions.count("BEGIN") == 2
    assert len([s for s in transactions if "FOR KEY SHARE" in s]) == 1  # the finish's
    assert [s for s in transactions if "server_keys" in s] == []
    assert "AgentStarted" in tags_of(db, machine_id)


def test_refused_ssh_fails_the_work_into_backoff(
        session: bmdb.Session, db: bmdb.BMDB, provider: EquinixProvider,
        simulator: Simulator, settings: InitializerSettings) -> None:
    machine_id, provider_id = provision(session, provider, simulator)
    simulator.faults.set(device_id=provider_id, ssh_refused=True)
    wait_until(lambda: refuses(simulator, provider_id), timeout=3, what="SSH refusing")
    result = initialize(claim_one(session, bmdb.Process.AGENT_START), provider, settings)
    assert result.outcome == "failed" and "ConnectionRefused" in (result.cause or "")
    assert result.backoff_seconds == 300  # the AgentStart default
    latest = history(db, machine_id)[0]
    assert latest["event"] == "Failed" and latest["cause"] == result.cause
    assert "AgentStarted" not in tags_of(db, machine_id)
    assert session.held_work() == []
    with pytest.raises(bmdb.MachineInBackoff):
        session.claim_machine(bmdb.Process.AGENT_START, machine_id)


def test_unknown_device_fails_with_the_long_backoff(
        session: bmdb.Session, db: bmdb.BMDB, provider: EquinixProvider,
        settings: InitializerSettings) -> None:
    ghost = ProviderMachine(provider_id=str(uuid.uuid4()), address="127.100.9.9", ssh_port=22,
                            location=None, reservation_id=None,
                            status=bmdb.ProviderStatus.RUNNING, failed=False)
    machine_id = session.transact(lambda tx: register_provided(tx, provider.name, ghost))
    result = initialize(claim_one(session, bmdb.Process.AGENT_START), provider, settings)
    assert result.outcome == "failed" and "not found" in (result.cause or "")
    assert result.backoff_seconds == PERMANENT_BACKOFF.initial
    assert history(db, machine_id)[0]["event"] == "Failed"
    assert session.held_work() == []


def test_agent_error_answer_fails_the_work(
        session: bmdb.Session, db: bmdb.BMDB, provider: EquinixProvider,
        simulator: Simulator, settings: InitializerSettings) -> None:
    """A takeover the agent itself refuses (an unusable CA) ends as Failed with its words."""
    machine_id, _ = provision(session, provider, simulator)
    broken = dataclasses.replace(settings, callback_url="https://127.0.0.1:9",
                                 ca_certificate="not a PEM certificate")
    result = initialize(claim_one(session, bmdb.Process.AGENT_START), provider, broken)
    assert result.outcome == "failed"
    assert (result.cause or "").startswith("agent: reported error: ca_certificate")
    assert history(db, machine_id)[0]["event"] == "Failed"
    assert session.held_work() == []


#: A ladder for a simulator whose reboots take about a second.
FAST = RecovererSettings(ladder=LadderSettings(rung_timeout=8, boot_wait=8, poll_interval=0.1,
                                               banner_timeout=1))


def api_reboot(provider: EquinixProvider) -> PowerFor:
    """Recovery's power control for the simulator's devices: the provider's reboot API."""
    return lambda machine: ProviderPower(provider, machine.provider_id)


def test_recovery_reboots_and_returns_the_machine_to_agent_start(
        session: bmdb.Session, db: bmdb.BMDB, provider: EquinixProvider,
        simulator: Simulator, settings: InitializerSettings) -> None:
    machine_id, provider_id = start_agent(session, provider, simulator, settings, db)
    first_key = tags_of(db, machine_id)["AgentStarted"]["public_key"]
    assert simulator.kill_agent(provider_id) >= 1
    work = wait_until(lambda: session.claim_backlog(bmdb.Process.RECOVERY, 1), timeout=5,
                    what="the silent machine in the Recovery backlog")[0]
    assert work.machine_id == machine_id

    result = recover(work, provider, api_reboot(provider), FAST)

    assert result.ok, result.cause
    assert simulator.devices[provider_id].reboots == 1
    rungs = [h for h in history(db, machine_id) if h["event"] == "Rung"]
    assert [r["cause"].split(":")[0] for r in rungs] == ["rung 1 (graceful restart)"]
    assert "verified" in rungs[0]["cause"] and "not verified" not in rungs[0]["cause"]
    tags = tags_of(db, machine_id)
    assert "AgentStarted" not in tags and "AgentHeartbeat" not in tags
    assert history(db, machine_id)[0]["process"] == bmdb.Process.RECOVERY.value
    again = claim_one(session, bmdb.Process.AGENT_START)
    assert again.machine_id == machine_id
    # Full circle: once the device is back, AgentStart gives it a fresh agent and key.
    simulator.wait_for_state(provider_id, "active", timeout=5)
    simulator.wait_for_ssh(provider_id, timeout=5)
    assert initialize(again, provider, settings).ok
    # Every takeover makes a fresh key: the new one is recorded, and heard.
    assert tags_of(db, machine_id)["AgentStarted"]["public_key"] != first_key
    wait_until(lambda: "AgentHeartbeat" in tags_of(db, machine_id), timeout=8,
             what="a heartbeat from the restarted agent")


def test_a_machine_presenting_another_host_key_is_never_reset(
        session: bmdb.Session, db: bmdb.BMDB, provider: EquinixProvider,
        simulator: Simulator, settings: InitializerSettings) -> None:
    """Reinstalled behind Shepherd's back: SSH answers with a new key. Rung 0 fails on
    the mismatch and the ladder stops there: no reset of a machine that is up."""
    machine_id, provider_id = start_agent(session, provider, simulator, settings, db)
    pinned = simulator.host_key_line(provider_id)
    assert simulator.kill_agent(provider_id) >= 1
    presented = simulator.rotate_host_key(provider_id)
    work = wait_until(lambda: session.claim_backlog(bmdb.Process.RECOVERY, 1), timeout=5,
                      what="the silent machine in the Recovery backlog")[0]

    with_rung_0 = dataclasses.replace(FAST, agent_restart=settings)
    result = recover(work, provider, api_reboot(provider), with_rung_0)

    assert result.outcome == "failed"
    cause = result.cause or ""
    assert "host key mismatch" in cause and "no reset tried" in cause
    assert key_line_fingerprint(pinned) in cause and key_line_fingerprint(presented) in cause
    assert simulator.devices[provider_id].reboots == 0
    rungs = [h["cause"] for h in history(db, machine_id) if h["event"] == "Rung"]
    assert len(rungs) == 1 and rungs[0].startswith("rung 0 (agent restart): not verified")
    assert "AgentStarted" in tags_of(db, machine_id)  # nothing dropped on failure
    assert session.held_work() == []
    # Held with the key it met, until an operator accepts it: then rung 0 restarts
    # the agent under the accepted pin, and still nothing is reset.
    [held] = db.read(lambda tx: bmdb.holds_of(tx, machine_id, bmdb.HOST_KEY_HOLD))
    assert held.host_key == presented and key_line_fingerprint(pinned) in held.reason
    assert session.claim_backlog(bmdb.Process.RECOVERY, 1) == []
    accepted = operations.accept_host_key(session, machine_id, "reinstalled by hand", "alice")
    assert (accepted.fingerprint, accepted.replaced) == (key_line_fingerprint(presented),
                                                         key_line_fingerprint(pinned))
    assert db.read(lambda tx: bmdb.machine_backoffs(tx, machine_id)) == []
    work = claim_one(session, bmdb.Process.RECOVERY)
    assert recover(work, provider, api_reboot(provider), with_rung_0).ok
    assert simulator.devices[provider_id].reboots == 0
    rungs = [h["cause"] for h in history(db, machine_id) if h["event"] == "Rung"]
    assert rungs[0].startswith("rung 0 (agent restart): verified"), rungs  # newest first


def test_agent_start_meeting_another_host_key_holds_the_machine(
        session: bmdb.Session, db: bmdb.BMDB, provider: EquinixProvider,
        simulator: Simulator, settings: InitializerSettings) -> None:
    """A first-use pin, then the machine's agent record dropped (as ``shepherd up``
    resuming does) and its key changed: AgentStart uploads nothing and holds the
    machine; accepting the key it met is the one step, refused once nothing is held."""
    machine_id, provider_id = start_agent(session, provider, simulator, settings, db)
    session.transact(lambda tx: bmdb.forget_every_agent(tx))
    presented = simulator.rotate_host_key(provider_id)
    result = initialize(claim_one(session, bmdb.Process.AGENT_START), provider, settings)
    assert result.outcome == "failed" and "held until an operator" in (result.cause or "")
    [held] = db.read(lambda tx: bmdb.holds_of(tx, machine_id))
    assert (held.kind, held.host_key, held.actor) == (bmdb.HOST_KEY_HOLD, presented,
                                                      "ShepherdAgentStart")
    assert session.claim_backlog(bmdb.Process.AGENT_START, 1) == []
    with pytest.raises(operations.BadArgument, match="--reason is required"):
        operations.accept_host_key(session, machine_id, " ", "alice")

    operations.accept_host_key(session, machine_id, "reinstalled by hand", "alice")
    with pytest.raises(operations.NothingToAccept, match="not held for a host-key mismatch"):
        operations.accept_host_key(session, machine_id, "again", "alice")
    assert initialize(claim_one(session, bmdb.Process.AGENT_START), provider, settings).ok
    pin = db.read(lambda tx: bmdb.recorded_host_key(tx, machine_id))
    assert pin is not None and (pin.host_key, pin.source) == (presented, bmdb.OPERATOR_PIN)


def test_no_second_reset_within_a_rung_timeout_of_an_earlier_one(
        session: bmdb.Session, db: bmdb.BMDB, provider: EquinixProvider,
        simulator: Simulator, settings: InitializerSettings) -> None:
    """An earlier attempt's worker was killed right after it asked a reset: its intent,
    recorded before the call, is all that is left. The next attempt resets nothing
    until one rung's timeout after it; then it climbs the ladder, its own reset
    recorded as asked before the call and acknowledged after."""
    machine_id, provider_id = start_agent(session, provider, simulator, settings, db)
    assert simulator.kill_agent(provider_id) >= 1
    via = f"provider {provider.name} device {provider_id}"
    session.transact(lambda tx: bmdb.record_power_asked(tx, machine_id, "graceful_restart",
                                                        via))

    def recorded(machine: ProviderMachine) -> ProviderPower:
        recorder = recorder_for(session, provider, machine.provider_id)
        return ProviderPower(provider, machine.provider_id, recorder=recorder)

    work = wait_until(lambda: session.claim_backlog(bmdb.Process.RECOVERY, 1), timeout=5,
                      what="the silent machine in the Recovery backlog")[0]
    refused = recover(work, provider, recorded, FAST)
    assert refused.outcome == "failed", refused
    assert f"graceful_restart was asked of {via}" in (refused.cause or "")
    assert "(asked); no second reset before" in (refused.cause or "")
    assert refused.backoff_seconds is not None and 1 <= refused.backoff_seconds <= 8
    assert simulator.devices[provider_id].reboots == 0

    p = bmdb._schema.power_states  # as one rung's timeout (8 s) later
    session.transact(lambda tx: tx.execute(sa.update(p).values(
        acted_at=tx.now - dt.timedelta(seconds=9))))
    session.transact(lambda tx: bmdb.clear_backoff(tx, machine_id, bmdb.Process.RECOVERY))
    # An operator's boot-device change just now is no reset: the ladder goes on.
    session.transact(lambda tx: bmdb.record_power_action(
        tx, machine_id, "boot_device disk (once)", via))
    work = claim_one(session, bmdb.Process.RECOVERY)
    assert recover(work, provider, recorded, FAST).ok
    assert simulator.devices[provider_id].reboots == 1
    seen = db.read(lambda tx: bmdb.power_of(tx, machine_id))
    assert seen is not None and (seen.action, seen.outcome) == ("graceful_restart",
                                                               "acknowledged")
    asked = [h for h in history(db, machine_id) if (h["process"], h["event"]) == ("Power",
                                                                                  "Asked")]
    assert len(asked) == 2


def test_recovery_of_an_unknown_device_fails(
        session: bmdb.Session, db: bmdb.BMDB, provider: EquinixProvider) -> None:
    ghost = ProviderMachine(provider_id=str(uuid.uuid4()), address=None, ssh_port=22,
                            location=None, reservation_id=None,
                            status=bmdb.ProviderStatus.RUNNING, failed=False)

    def body(tx: bmdb.Tx) -> uuid.UUID:
        machine_id = register_provided(tx, provider.name, ghost)
        bmdb.set_agent_started(tx, machine_id, b"k" * 32)
        return machine_id

    machine_id = session.transact(body)
    now_silent = bmdb.Thresholds(first_heartbeat=0, heartbeat=0)
    [work] = session.claim(bmdb.Process.RECOVERY, bmdb.backlog.recovery_backlog(now_silent), 1)
    result = recover(work, provider, api_reboot(provider), FAST)
    assert result.outcome == "failed" and "not found" in (result.cause or "")
    assert "AgentStarted" in tags_of(db, machine_id)  # nothing dropped on failure
    assert session.held_work() == []


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_recovery_guard_pauses_on_a_fleet_wide_silence(
        backend: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue("pg_url" if backend == "postgresql" else "sqlite_url")
    guard_db = bmdb.connect(url)
    try:
        with guard_db.start_session("guard-test", interval=30) as session:
            machines = [add_machine(session, bytes([i]) * 32) for i in range(20)]
            now = dt.datetime.now(dt.UTC)

            def heard(tx: bmdb.Tx) -> None:
                for m in machines[:17]:
                    bmdb.record_heartbeat(tx, m, now)

            session.transact(heard)
        lenient = bmdb.Thresholds(first_heartbeat=3600, heartbeat=3600)
        strict = bmdb.Thresholds(first_heartbeat=0, heartbeat=3600)  # 3 never heard: 15 %
        assert recovery_paused(guard_db, lenient) is None
        reason = recovery_paused(guard_db, strict)
        assert reason is not None and "3 of 20" in reason
        assert recovery_paused(guard_db, strict, max_share=0.2) is None
        assert recovery_paused(guard_db, strict, min_silent=3) is None
    finally:
        guard_db.close()


class _StopAsked:
    """A provider whose lookup is interrupted by Celery's soft time limit."""

    name = "equinix"

    def get_machine(self, provider_id: str) -> ProviderMachine:
        from celery.exceptions import SoftTimeLimitExceeded

        raise SoftTimeLimitExceeded()


def test_a_soft_time_limit_fails_the_work_into_backoff(db: bmdb.BMDB,
                                                       settings: InitializerSettings) -> None:
    """What a stuck task does when Celery asks it to stop: the machine sits out a
    backoff, instead of being released by the sweep and claimed again at once."""
    with db.start_session("w", interval=30) as session:
        machine = ProviderMachine("dev-soft", "127.9.9.9", 22, None, None,
                                  bmdb.ProviderStatus.RUNNING, False)
        session.transact(lambda tx: register_provided(tx, "equinix", machine))
        work = claim_one(session, bmdb.Process.AGENT_START)
        result = initialize(work, _StopAsked(), settings)  # type: ignore[arg-type]
    assert (result.outcome, result.backoff_seconds) == ("failed", 300)
    assert "SoftTimeLimitExceeded" in (result.cause or "")
