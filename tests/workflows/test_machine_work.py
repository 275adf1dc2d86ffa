"""One machine's work from its claim to its outcome (``machine_work.run_machine_work``),
on real parts: simulator devices over SSH, the real agent and callback server, a real
BMDB (PostgreSQL). Adopting a dispatched claim, claiming by hand, the guard asked
again before a reboot, and a failure backed off by the BMDB's configured backoff."""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import bmdb
from shepherd import answer_key
from shepherd.power import PowerControl, ProviderPower
from shepherd.providers.base import ConfigError, Provider, ProviderMachine, register_provided
from shepherd.providers.equinix import EquinixProvider
from shepherd.server import RunningServer
from shepherd.simulator import Simulator
from shepherd.workflows import InitializerSettings, RecovererSettings, guard
from shepherd.workflows.guard import GuardDecision, GuardLimits
from shepherd.workflows.installation import InstallationSettings
from shepherd.workflows.machine_work import MachineParts, run_machine_work
from shepherd.workflows.recovery_claims import RecoveryPaused
from tests.support.agent_fixtures import tags_of
from tests.support.servers import free_port

AGENT_START, RECOVERY = bmdb.Process.AGENT_START, bmdb.Process.RECOVERY
#: What the BMDB backs a failed AgentStart off by, as ``shepherd.runtime`` configures it.
CONFIGURED = bmdb.Backoff(initial=7, maximum=7)


@dataclasses.dataclass
class Parts:
    """What a worker's ``Runtime`` gives a machine's work, held as built; without a
    provider, asking for it fails as building a misconfigured one does."""

    session: bmdb.Session
    built_provider: Provider | None
    initializer: InitializerSettings
    limits: GuardLimits = dataclasses.field(default_factory=GuardLimits)

    @property
    def provider(self) -> Provider:
        if self.built_provider is None:
            raise ConfigError("SHEPHERD_PROVIDER=static needs SHEPHERD_STATIC_INVENTORY")
        return self.built_provider

    def guard_limits(self, *, interactive: bool = False) -> GuardLimits:
        return self.limits

    def power_for(self, machine: ProviderMachine) -> PowerControl | None:
        return ProviderPower(self.provider, machine.provider_id)

    def initializer_settings(self) -> InitializerSettings:
        return self.initializer

    def recoverer_settings(self) -> RecovererSettings:
        return RecovererSettings(agent_restart=self.initializer)

    def installation_settings(self) -> InstallationSettings:
        return InstallationSettings(callback_url=self.initializer.callback_url,
                                    image_dir=Path("/nonexistent"))


@pytest.fixture
def db(pg_url: str) -> Iterator[bmdb.BMDB]:
    handle = bmdb.connect(pg_url, thresholds=bmdb.Thresholds(first_heartbeat=60, heartbeat=30),
                          backoffs={AGENT_START: CONFIGURED})
    yield handle
    handle.close()


@pytest.fixture
def worker(db: bmdb.BMDB) -> Iterator[bmdb.Session]:
    with db.start_session("worker", interval=30) as session:
        yield session


@pytest.fixture
def parts(worker: bmdb.Session, provider: EquinixProvider, ssh_key: Path,
          callback_server: RunningServer) -> Parts:
    return Parts(worker, provider, InitializerSettings(
        ssh_key_path=ssh_key, callback_url=callback_server.url, connect_timeout=3.0,
        exec_timeout=15.0, agent_args=("--interval", "0.3", "--max-backoff", "1")))


def unreachable() -> GuardLimits:
    """A guard whose callback server does not answer: Recovery pauses."""
    return GuardLimits(max_share=1.0, healthz_url=f"http://127.0.0.1:{free_port()}/healthz",
                       healthz_timeout=0.5)


def provision(db: bmdb.BMDB, provider: EquinixProvider, simulator: Simulator) -> uuid.UUID:
    """A device up and Running in the BMDB: in the AgentStart backlog."""
    created = provider.create_machine(provider.list_capacity()[0])
    simulator.wait_for_state(created.provider_id, "active", timeout=5)
    simulator.wait_for_ssh(created.provider_id, timeout=5)
    machine = provider.get_machine(created.provider_id)
    with db.start_session("setup", interval=30) as session:
        return session.transact(lambda tx: register_provided(tx, provider.name, machine))


def silent(db: bmdb.BMDB) -> uuid.UUID:
    """A machine whose agent started long ago and was never heard: Recovery's backlog."""
    machine = ProviderMachine(f"dev-{uuid.uuid4()}", "127.9.0.1", 22, None, None,
                              bmdb.ProviderStatus.RUNNING, False)

    def body(tx: bmdb.Tx) -> uuid.UUID:
        machine_id = register_provided(tx, "equinix", machine)
        bmdb.set_agent_started(tx, machine_id, bytes(32),
                               started_at=tx.now - dt.timedelta(hours=1))
        return machine_id

    with db.start_session("setup", interval=30) as session:
        return session.transact(body)


def dispatched(db: bmdb.BMDB, process: bmdb.Process) -> bmdb.Work:
    """A claim of ``process``'s backlog made by another session, as sourcing makes it."""
    with db.start_session("sourcer", interval=30) as sourcer:
        [work] = sourcer.claim_backlog(process, 1, dispatch_ttl=30)
        return work


def events(db: bmdb.BMDB, machine_id: uuid.UUID) -> list[str]:
    return [h["event"] for h in db.read(lambda tx: bmdb.machine_history(tx, machine_id))]


def work_held(db: bmdb.BMDB) -> int:
    return db.read(lambda tx: sum(bmdb.active_work(tx, p) for p in (AGENT_START, RECOVERY)))


def test_a_dispatched_claim_is_adopted_and_run_once(db: bmdb.BMDB, parts: Parts,
                                                     provider: EquinixProvider,
                                                     simulator: Simulator) -> None:
    machine_id = provision(db, provider, simulator)
    work = dispatched(db, AGENT_START)

    result = run_machine_work(parts, AGENT_START, machine_id, work.id)

    assert (result.outcome, result.work_id, result.cause) == ("finished", work.id, None)
    assert "AgentStarted" in tags_of(db, machine_id)
    seen = events(db, machine_id)
    # Delivered again (late acks): the claim is gone, the machine untouched.
    again = run_machine_work(parts, AGENT_START, machine_id, work.id)
    assert (again.outcome, again.cause) == ("gone", "already adopted or released")
    assert events(db, machine_id) == seen and work_held(db) == 0


def test_by_hand_the_machine_is_claimed_under_the_same_rules(
        db: bmdb.BMDB, parts: Parts, provider: EquinixProvider,
        simulator: Simulator) -> None:
    busy, free = provision(db, provider, simulator), provision(db, provider, simulator)
    with db.start_session("operator", interval=30) as other:
        other.claim_machine(AGENT_START, busy)
        with pytest.raises(bmdb.MachineBusy, match="held by session"):
            run_machine_work(parts, AGENT_START, busy)
        assert events(db, busy) == ["Started"]  # the operator's claim alone
        assert "AgentStarted" not in tags_of(db, busy)

    result = run_machine_work(parts, AGENT_START, free)

    assert result.outcome == "finished" and "AgentStarted" in tags_of(db, free)
    newest = db.read(lambda tx: bmdb.machine_history(tx, free))[0]
    assert (newest["event"], str(newest["work_id"])) == ("Finished", str(result.work_id))
    with pytest.raises(bmdb.NotInBacklog):  # started now: AgentStart has nothing to do
        run_machine_work(parts, AGENT_START, free)


def test_recovery_by_hand_asks_the_guard_first_and_claims_nothing_when_paused(
        db: bmdb.BMDB, parts: Parts) -> None:
    machine_id = silent(db)
    decisions: list[GuardDecision] = []
    paused = dataclasses.replace(parts, limits=unreachable())

    with pytest.raises(RecoveryPaused, match="callback server"):
        run_machine_work(paused, RECOVERY, machine_id, on_decision=decisions.append)

    assert [d.causes for d in decisions] == [(guard.CALLBACK_SERVER,)]
    assert events(db, machine_id) == [] and work_held(db) == 0


def test_an_adopted_recovery_is_cancelled_when_the_guard_pauses_at_execution(
        db: bmdb.BMDB, parts: Parts) -> None:
    """The guard is asked again right before the reboot: the callback server may have
    failed since the claim was sourced."""
    machine_id = silent(db)
    work = dispatched(db, RECOVERY)
    decisions: list[GuardDecision] = []

    result = run_machine_work(dataclasses.replace(parts, limits=unreachable()), RECOVERY,
                              machine_id, work.id, on_decision=decisions.append)

    assert result.outcome == "paused" and "unreachable" in (result.cause or ""), result
    assert events(db, machine_id) == ["Canceled", "Started"]
    assert "AgentStarted" in tags_of(db, machine_id)  # nothing rebooted, nothing dropped
    assert len(decisions) == 1 and decisions[0].paused == result.cause
    assert db.read(lambda tx: bmdb.machine_backoffs(tx, machine_id)) == []


def test_a_workflow_that_cannot_start_fails_the_claim_with_the_configured_backoff(
        db: bmdb.BMDB, parts: Parts, provider: EquinixProvider,
        simulator: Simulator) -> None:
    """The provider is built when the workflow first needs it, after the claim: its
    failure fails the claim (never left held), backed off as the BMDB was configured."""
    machine_id = provision(db, provider, simulator)
    broken = dataclasses.replace(parts, built_provider=None)

    result = run_machine_work(broken, AGENT_START, machine_id)

    assert result.outcome == "failed", result
    assert (result.cause or "").startswith("worker: ConfigError: SHEPHERD_PROVIDER=static")
    assert result.backoff_seconds == CONFIGURED.initial
    assert events(db, machine_id) == ["Failed", "Started"] and work_held(db) == 0


def test_a_dispatched_claim_whose_reads_fail_is_failed_with_a_backoff(
        db: bmdb.BMDB, parts: Parts, provider: EquinixProvider,
        simulator: Simulator) -> None:
    """AgentStart reads what it needs in the transaction that adopts its claim. Should
    that read fail (here the fleet's answer key in the BMDB is not a key), the claim is
    still adopted and failed with its backoff: never left for the sweep to release and
    sourcing to hand out again at once."""
    machine_id = provision(db, provider, simulator)
    db.read(lambda tx: bmdb.ensure_server_key(tx, answer_key.KEY_NAME, b"not a key"))
    work = dispatched(db, AGENT_START)

    result = run_machine_work(parts, AGENT_START, machine_id, work.id)

    assert result.outcome == "failed" and "ValueError" in (result.cause or ""), result
    assert result.backoff_seconds == CONFIGURED.initial
    assert events(db, machine_id) == ["Failed", "Started"] and work_held(db) == 0


def test_only_per_machine_processes_have_machine_work(parts: Parts) -> None:
    with pytest.raises(ValueError, match="no per-machine workflow"):
        run_machine_work(parts, bmdb.Process.POWER, uuid.uuid4())


def test_the_bmdb_backs_a_failure_off_as_configured(db: bmdb.BMDB, pg_url: str) -> None:
    """``connect(backoffs=)`` is what a failure without a backoff of its own gets; the
    other processes keep the built-in ones."""
    assert db.backoff_for(AGENT_START) == CONFIGURED
    assert db.backoff_for(RECOVERY) == bmdb.default_backoff(RECOVERY)
    plain = bmdb.connect(pg_url)
    try:
        assert plain.backoff_for(AGENT_START) == bmdb.default_backoff(AGENT_START)
    finally:
        plain.close()


def test_a_runtime_is_what_machine_work_takes() -> None:
    """The worker passes its ``Runtime``: it must keep offering what the work needs."""
    from shepherd.runtime import Runtime

    wanted = {name for name in dir(MachineParts) if not name.startswith("_")}
    assert wanted <= set(dir(Runtime)), wanted - set(dir(Runtime))
