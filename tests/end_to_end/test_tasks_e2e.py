"""The Celery layer: in-process checks of the task bodies on a real BMDB (fast), then end
to end (``slow``): real ``celery worker`` and ``celery beat`` processes on real Redis and
PostgreSQL, the simulator's devices over SSH, the real agent and callback server; every
process on loopback, each test bounded in time (``tests/celery_fixtures``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import signal
import time
import uuid
from collections import Counter
from typing import Any, cast

import pytest

import bmdb
import celeryconfig
from shepherd.agent import BUNDLE_NAME
from shepherd.operations.explain import explain
from shepherd.os_processes import marked_processes
from shepherd.simulator.ssh import MARKER as SIM_DEVICE
from tests.support.celery_fixtures import ControlPlane, dump, overlapping_work
from tests.support.servers import free_port
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.timeout(150)]
slow = pytest.mark.slow


def all_heartbeating(n: int):
    return lambda c: c.provided == n and c.agent_started == n and c.heartbeating == n


def events(cp: ControlPlane, process: bmdb.Process | None = None,
           event: str | None = None) -> list[dict]:
    return [h for h in cp.history() if (process is None or h["process"] == process.value)
            and (event is None or h["event"] == event)]


@slow
def test_thirty_reservations_become_heartbeating_machines(control_plane) -> None:
    cp = control_plane(reservations=30)
    cp.start_worker("w1")
    cp.start_beat()

    cp.wait_for(lambda c: c.provided == 30, timeout=40, what="30 Provided machines")
    cp.wait_for(lambda c: c.agent_started == 30, timeout=60, what="30 AgentStarted")
    cp.wait_for(all_heartbeating(30), timeout=20, what="30 heartbeating")

    finished = events(cp, bmdb.Process.AGENT_START, bmdb.Event.FINISHED)
    assert len({h["machine_id"] for h in finished}) == 30
    assert not events(cp, bmdb.Process.RECOVERY)
    assert overlapping_work(cp.history()) == []
    assert cp.log_problems("w1", "beat") == []


def machine_events(cp: ControlPlane, machine_id: uuid.UUID) -> list[tuple[str, str]]:
    return [(h["process"], h["event"]) for h in cp.history() if h["machine_id"] == machine_id]


@slow
def test_refused_ssh_fails_with_the_backoff_then_succeeds(control_plane) -> None:
    cp = control_plane(reservations=4)
    cp.simulator.faults.set(ssh_refused=True)
    cp.start_worker("w1")
    cp.start_beat()
    cp.wait_for(lambda c: c.provided == 4, timeout=30, what="4 Provided machines")

    def failed_twice_each() -> bool:
        failed = Counter(h["machine_id"] for h in events(cp, bmdb.Process.AGENT_START,
                                                         bmdb.Event.FAILED))
        return len(failed) == 4 and min(failed.values()) >= 2

    wait_until(failed_twice_each, 40, "two AgentStart failures per machine", cp)
    failed = events(cp, bmdb.Process.AGENT_START, bmdb.Event.FAILED)
    assert all("ConnectionRefused" in (h["cause"] or "") for h in failed), dump(failed)
    backoffs = cp.db.read(lambda tx: [dict(r._mapping) for r in
                                      tx.execute(bmdb._schema.backoff.select())])
    assert backoffs and all(b["interval_s"] in (1, 2) for b in backoffs), dump(backoffs)
    assert all("ConnectionRefused" in b["cause"] for b in backoffs)
    assert cp.counts().agent_started == 0

    cp.simulator.faults.clear()
    cp.wait_for(all_heartbeating(4), timeout=40, what="4 heartbeating after the fault")
    assert cp.counts().active_backoffs[bmdb.Process.AGENT_START.value] == 0
    # Every retry waited out its backoff (1 s, then 2 s: SHEPHERD_AGENT_START_BACKOFF).
    per_machine: dict[uuid.UUID, list[dict]] = {}
    for h in events(cp, bmdb.Process.AGENT_START):
        per_machine.setdefault(h["machine_id"], []).append(h)
    for rows in per_machine.values():
        assert rows[-1]["event"] == bmdb.Event.FINISHED
        failures = 0
        for previous, row in itertools.pairwise(rows):
            if previous["event"] == bmdb.Event.FAILED:
                failures += 1
                wait = (row["at"] - previous["at"]).total_seconds()
                assert row["event"] == bmdb.Event.STARTED and wait >= min(failures, 2), \
                    dump(rows)
    # Expected failures are reported without tracebacks; the tasks ended as FAILURE.
    worker_log = cp.log("w1")
    assert "raised expected: MachineWorkFailed" in worker_log
    assert "Traceback" not in worker_log
    assert overlapping_work(cp.history()) == []


@slow
def test_killed_agent_is_recovered_and_heartbeats_again(control_plane) -> None:
    """Rung 0: the agent died but the machine answers SSH with its pinned host key, so
    Recovery restarts only the agent; nothing is rebooted."""
    cp = control_plane(reservations=5, SHEPHERD_RECOVERY_MAX_SHARE="0.5")
    cp.start_worker("w1")
    cp.start_beat()
    cp.wait_for(all_heartbeating(5), timeout=60, what="5 heartbeating")
    victim = cp.machine_ids()[0]
    provider_id = cp.provider_id(victim)
    first = cp.tags(victim)["AgentStarted"]

    assert cp.simulator.kill_agent(provider_id) >= 1

    def recovered() -> dict | None:
        done = [h for h in events(cp, bmdb.Process.RECOVERY, bmdb.Event.FINISHED)
                if h["machine_id"] == victim]
        return done[0] if done else None

    finished = wait_until(recovered, 60, "Recovery of the silent machine", cp)
    assert all(d.reboots == 0 for d in cp.simulator.devices.values())

    def heard_again() -> bool:
        beat = cp.tags(victim).get("AgentHeartbeat")
        return beat is not None and beat["last_heartbeat_at"] > finished["at"]

    wait_until(heard_again, 60, "heartbeats from the restarted agent", cp)
    cp.wait_for(all_heartbeating(5), timeout=10, what="the whole fleet heartbeating")
    # Every takeover makes a fresh key and gets a fresh nonce: both replace the old.
    now = cp.tags(victim)["AgentStarted"]
    assert now["public_key"] != first["public_key"] and now["nonce"] != first["nonce"]
    rungs = [h["cause"] for h in cp.history()
             if h["machine_id"] == victim and h["event"] == "Rung"]
    assert len(rungs) == 1 and rungs[0].startswith("rung 0 (agent restart): verified")
    history = machine_events(cp, victim)
    recovery_at = history.index(("ShepherdRecovery", "Finished"))
    assert ("ShepherdAgentStart", "Started") not in history[recovery_at:]
    assert len(events(cp, bmdb.Process.RECOVERY, bmdb.Event.STARTED)) == 1
    assert overlapping_work(cp.history()) == []


@slow
def test_callback_server_outage_pauses_recovery(control_plane) -> None:
    # The pause under test is the callback server's. The allowance of one silent
    # machine whatever the share (SHEPHERD_RECOVERY_MIN_SILENT, default 1) would let
    # Recovery take the last agent to heartbeat again after the outage (as the share
    # rule lets it take the last 10 % of a large fleet): set to 0, every straggler
    # keeps the share above its limit, and any Recovery here is the pause failing.
    cp = control_plane(reservations=5, SHEPHERD_RECOVERY_MIN_SILENT="0")
    cp.start_worker("w1")
    cp.start_beat()
    cp.wait_for(all_heartbeating(5), timeout=60, what="5 heartbeating")

    cp.stop_callback_server()
    cp.wait_for(lambda c: c.heartbeating == 0, timeout=15, what="every agent silent")
    wait_until(lambda: "RECOVERY PAUSED" in cp.log("w1"), 10, "the pause in the log", cp)

    def decided() -> dict | None:
        """A sourcing's answer by hand; None while the beat's own sourcing holds the
        process (``skipped``: no decision in it), as it does every 0.1 s here."""
        answer = cp.client.send_task("shepherd.source", args=["ShepherdRecovery"]).get(
            timeout=20)
        return None if "skipped" in answer else answer

    paused = wait_until(decided, 30, "a sourcing by hand that the beat's did not skip", cp)
    assert "callback server" in paused.get("paused", ""), paused
    assert paused["guard"]["silent"] == 5, paused
    time.sleep(2)  # a few more beats of sourcing while silent

    cp.start_callback_server()
    cp.wait_for(all_heartbeating(5), timeout=20, what="heartbeats after the outage")
    time.sleep(1)
    assert not events(cp, bmdb.Process.RECOVERY), dump(events(cp, bmdb.Process.RECOVERY))
    assert all(d.reboots == 0 for d in cp.simulator.devices.values())
    assert cp.counts().agent_started == 5


def signal_agents(cp: ControlPlane, machine_ids: list[uuid.UUID], signum: int) -> int:
    """Send ``signum`` to every process the machines' simulated devices run."""
    pids = [pid for machine in machine_ids
            for pid in marked_processes(SIM_DEVICE, cp.provider_id(machine))]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
    return len(pids)


@slow
def test_no_agent_is_restarted_after_a_callback_server_outage(control_plane) -> None:
    """The outage ends; two agents come back late (stopped for a moment, as a long
    retry backoff would keep them). The silent share is then 2 of 20, within the
    guard's 10 %, and the callback server answers: only the grace after heartbeats
    resumed (``bmdb.resumptions``) keeps Recovery off them, and explain says so."""
    # A first heartbeat may take more than the plane's 5 s on a loaded host: 30 s, so
    # no Recovery of a new agent is mistaken for one after the outage.
    cp = control_plane(reservations=20, SHEPHERD_HEARTBEAT_TIMEOUT="10",
                       SHEPHERD_FIRST_HEARTBEAT_TIMEOUT="30")
    cp.start_worker("w1")
    cp.start_beat()
    cp.wait_for(all_heartbeating(20), timeout=90, what="20 heartbeating")
    started = {m: cp.tags(m)["AgentStarted"]["started_at"] for m in cp.machine_ids()}
    late = cp.machine_ids()[:2]

    cp.stop_callback_server()
    cp.wait_for(lambda c: c.heartbeating == 0, timeout=25, what="every agent silent")
    try:
        assert signal_agents(cp, late, signal.SIGSTOP) >= 2
        cp.start_callback_server()
        cp.wait_for(lambda c: c.heartbeating == 18, timeout=8, what="18 heartbeating again")
        reason = wait_until(lambda: grace_reason(cp, late[0]), 5, "explain's grace", cp)
        assert "heartbeats resumed fleet-wide" in reason and "callback server" in reason
        time.sleep(2)  # four sourcing passes with 2 of 20 silent
    finally:
        signal_agents(cp, late, signal.SIGCONT)
    cp.wait_for(all_heartbeating(20), timeout=15, what="the late agents heartbeating")
    time.sleep(1)
    assert not events(cp, bmdb.Process.RECOVERY), dump(events(cp, bmdb.Process.RECOVERY))
    assert {m: cp.tags(m)["AgentStarted"]["started_at"] for m in started} == started
    assert all(d.reboots == 0 for d in cp.simulator.devices.values())


def grace_reason(cp: ControlPlane, machine: uuid.UUID) -> str | None:
    """Recovery's backlog reason in ``explain`` once the machine is stale, else None."""
    explained = cp.db.read(lambda tx: explain(tx, machine, cp.thresholds))
    (recovery,) = [p for p in explained.processes if p.process == "ShepherdRecovery"]
    assert not recovery.in_backlog, recovery
    return recovery.backlog if recovery.backlog.startswith("heartbeat stale") else None


@slow
def test_two_workers_share_the_work_and_survive_a_lost_one(control_plane) -> None:
    """Two machine workers beside a control worker, as deployed (docker/compose.yaml).

    Why the control worker: with every queue on w1 and w2, the worker running the
    long reconcile, or the sourcing that publishes an AgentStart, has no free slot
    when the AgentStart arrives, so the other worker could take every one of them.
    """
    cp = control_plane(reservations=20, SHEPHERD_IN_FLIGHT_CAP="6",
                       SHEPHERD_DISPATCH_TTL="8")
    cp.start_worker("control", queues="shepherd.control")
    cp.start_worker("w1", queues="shepherd.machines")
    cp.start_worker("w2", queues="shepherd.machines")
    cp.start_beat()
    cp.wait_for(lambda c: c.agent_started >= 1, timeout=60, what="a first AgentStarted")
    pools = {"w1": cp.pool_pids("w1"), "w2": cp.pool_pids("w2")}

    def shared() -> Counter[str] | None:
        """Finished AgentStarts by machine worker, once both have some."""
        sessions = cp.db.read(lambda tx: {r.id: int(r.holder.rsplit(":", 1)[1]) for r in
                                          tx.execute(bmdb._schema.sessions.select())})
        by_node: Counter[str] = Counter()
        for h in events(cp, bmdb.Process.AGENT_START, bmdb.Event.FINISHED):
            pid = sessions.get(h["session_id"])
            by_node.update(node for node, pids in pools.items() if pid in pids)
        return by_node if by_node["w1"] > 0 and by_node["w2"] > 0 else None

    wait_until(shared, 60, "both machine workers finishing AgentStarts", cp)

    def held_by_w2() -> list | None:
        """Claims w2's pool has adopted (mid-SSH), if any right now."""
        def read(tx: bmdb.Tx) -> list:
            pids = {r.id: int(r.holder.rsplit(":", 1)[1])
                    for r in tx.execute(bmdb._schema.sessions.select())}
            return [r for r in tx.execute(bmdb._schema.work.select())
                    if r.dispatch_deadline is None and pids.get(r.session_id) in pools["w2"]]

        return cp.db.read(read) or None

    held = wait_until(held_by_w2, 30, "w2 holding adopted work", cp)
    cp.kill("w2")  # a lost host: SIGKILL to the whole worker, mid-SSH
    cp.wait_for(all_heartbeating(20), timeout=70, what="20 heartbeating with w1 alone")
    assert overlapping_work(cp.history()) == []
    abandoned = {h["work_id"] for h in events(cp, bmdb.Process.AGENT_START,
                                              bmdb.Event.ABANDONED)}
    assert {r.id for r in held} <= abandoned, (held, abandoned)  # released, then redone
    started = Counter(h["machine_id"] for h in events(cp, bmdb.Process.AGENT_START,
                                                      bmdb.Event.FINISHED))
    assert set(started) == set(cp.machine_ids())


@slow
def test_a_worker_killed_mid_create_leaves_no_stranger(control_plane) -> None:
    """SIGKILL between the provider creating a device and the BMDB recording it: the
    next reconcile recognises the device by its creation intent and registers it,
    instead of stopping every later run on a machine the BMDB does not know."""
    from pathlib import Path

    from shepherd.providers import ssh_keys
    from tests.support.simulator_fixtures import fast_client

    cp = control_plane(reservations=3, SHEPHERD_CHUNK_SIZE="1")
    sim = cp.simulator
    creates = f"/projects/{sim.project_id}/devices"
    key = ssh_keys.load_or_create(Path(cp.env["SHEPHERD_SSH_KEY_PATH"]))
    fast_client(sim).create_ssh_key(cp.env["SHEPHERD_SSH_KEY_LABEL"],
                                    ssh_keys.public_key_openssh(key))  # so POSTs are creates
    sim.faults.fail_after_apply_next(1, 500, method="POST")  # created, answered 500
    cp.start_worker("w1")
    cp.start_beat()

    def created_unanswered() -> bool:
        return any(r.status == 500 and r.applied for r in sim.requests("POST", creates))

    wait_until(created_unanswered, 30, "a create applied and answered 500", cp)
    sim.faults.set(api_latency=10.0)  # the client's re-read of the reservation hangs
    cp.kill("w1")  # ... and the creator dies there, its transaction uncommitted
    orphan = next(d.id for d in sim.devices.values() if d.created_by == "api")
    assert orphan not in {cp.provider_id(m) for m in cp.machine_ids()}

    sim.faults.clear()
    cp.start_worker("w2")
    cp.wait_for(all_heartbeating(3), timeout=90, what="3 heartbeating after the kill")
    assert orphan in {cp.provider_id(m) for m in cp.machine_ids()}
    assert "FLEET MISMATCH" not in cp.log("w2")
    assert "creation was interrupted" in cp.log("w2")
    applied = Counter(r.reservation_id for r in sim.requests("POST", creates) if r.applied)
    assert len(applied) == 3 and set(applied.values()) == {1}  # none created twice


@slow
def test_per_machine_task_by_hand(control_plane) -> None:
    """Manual use: ``celery -A tasks call`` and ``from tasks import ...``; a busy machine
    or one in backoff is left untouched and the task says why."""
    cp = control_plane(reservations=2)
    cp.start_worker("w1")  # no beat: everything below is called by hand

    called = cp.cli("call", "shepherd.reconcile")
    assert called.returncode == 0, called.stderr
    created = cp.client.AsyncResult(called.stdout.strip()).get(timeout=30)
    assert len(created["created"]) == 2, created

    def running() -> bool:
        cp.client.send_task("shepherd.update").get(timeout=20)
        return cp.counts().backlog[bmdb.Process.AGENT_START.value] == 2

    wait_until(running, 20, "both machines Running", cp)
    busy, free = cp.machine_ids()
    session = cp.db.start_session("e2e-operator", interval=30)
    try:
        held = session.claim_machine(bmdb.Process.AGENT_START, busy)
        before = machine_events(cp, busy)

        called = cp.cli("call", "shepherd.agent_start", "--args", json.dumps([str(busy)]))
        result = cp.client.AsyncResult(called.stdout.strip())
        result.get(timeout=30, propagate=False)
        assert result.state == "FAILURE"
        assert type(result.result).__name__ == "MachineNotClaimable"
        assert "held by session" in str(result.result) and str(busy) in str(result.result)
        assert machine_events(cp, busy) == before
        assert not (cp.simulator.sandbox(cp.provider_id(busy)) / BUNDLE_NAME).exists()

        held.fail("operator: testing", bmdb.Backoff(initial=60))
        shell = cp.cli("python", "-c", (
            "from tasks import agent_start\n"
            f"r = agent_start.delay('{busy}')\n"
            "r.get(timeout=30, propagate=False)\n"
            "print(r.state, r.result)\n"))
        assert shell.returncode == 0, shell.stderr
        assert shell.stdout.startswith("FAILURE") and "in backoff until" in shell.stdout, \
            shell.stdout
        assert "AgentStarted" not in cp.tags(busy)
    finally:
        session.close()

    stale = cp.client.send_task("shepherd.agent_start", args=[str(free), str(uuid.uuid4())])
    assert stale.get(timeout=30)["outcome"] == "gone"
    assert "AgentStarted" not in cp.tags(free)

    done = cp.client.send_task("shepherd.agent_start", args=[str(free)]).get(timeout=30)
    assert done["outcome"] == "finished", done
    assert "AgentStarted" in cp.tags(free)

    guard = cp.cli("call", "shepherd.recovery_guard")
    status = cp.client.AsyncResult(guard.stdout.strip()).get(timeout=30)
    assert {"paused", "allowed", "silent", "started"} <= set(status), status
    called = cp.cli("call", "shepherd.recovery", "--args", json.dumps([str(free)]))
    refused = cp.client.AsyncResult(called.stdout.strip())
    refused.get(timeout=30, propagate=False)  # just started: not silent, not due
    assert refused.state == "FAILURE", refused.result
    assert "not in its backlog" in str(refused.result), refused.result
    assert cp.simulator.devices[cp.provider_id(free)].reboots == 0
    swept = cp.client.send_task("shepherd.sweep").get(timeout=20)
    assert set(swept) == {"abandoned", "unadopted", "sessions_deleted"}


@slow
def test_flower_lists_workers_and_tasks(control_plane) -> None:
    cp = control_plane(reservations=3)
    port = free_port()
    cp.start_worker("w1")
    cp.start_beat()
    cp.start_flower(port)
    cp.wait_for(all_heartbeating(3), timeout=60, what="3 heartbeating")
    http = cp.http()
    http.auth = ("e2e", "e2e-pass")
    base = f"http://127.0.0.1:{port}/api"
    assert cp.http().get(f"{base}/workers", timeout=10).status_code == 401  # no credentials

    def workers() -> dict:
        answer = http.get(f"{base}/workers", params={"refresh": "1"}, timeout=20)
        return answer.json() if answer.status_code == 200 else {}

    listed = wait_until(workers, 30, "Flower listing the worker", cp)
    assert any(name.startswith("w1@") for name in listed), list(listed)

    def machine_tasks() -> dict:
        answer = http.get(f"{base}/tasks", params={"taskname": "shepherd.agent_start"},
                          timeout=10)
        tasks = answer.json() if answer.status_code == 200 else {}
        return tasks if len(tasks) >= 3 else {}

    tasks = wait_until(machine_tasks, 30, "Flower listing the AgentStart tasks", cp)
    machine_ids = {str(m) for m in cp.machine_ids()}
    assert {t["state"] for t in tasks.values()} == {"SUCCESS"}
    # Sourced with no result kept: the outcome Flower shows came with the worker's events.
    assert all("'outcome': 'finished'" in t["result"] for t in tasks.values()), tasks
    # A worker sends no task-sent events (sourcing's dispatch); beat, every 0.5 s, does.
    assert all(t["sent"] is None for t in tasks.values()), tasks
    sourcings = http.get(f"{base}/tasks", params={"taskname": "shepherd.source"},
                         timeout=10).json()
    assert any(t["sent"] for t in sourcings.values()), sourcings
    assert {str(t["args"]).split("'")[1] for t in tasks.values()} == machine_ids
    everything = http.get(f"{base}/tasks", timeout=10).text
    assert "shepherd.source" in everything and "shepherd.reconcile" in everything
    assert cp.env["SHEPHERD_PROVIDER_TOKEN"] not in everything


# -- in process: the task bodies on a real BMDB, no broker needed ---------------------


class UntouchableProvider:
    """A provider whose every call fails the test: "touching nothing" is checked by it."""

    name = "equinix"

    def __getattr__(self, item: str):
        raise AssertionError(f"the provider was used ({item}) where nothing may be touched")


@pytest.fixture
def state(pg_url: str):
    """The tasks' runtime (``app.runtime``), pointed at a fresh BMDB; restored afterwards.
    ``reconfigure(state, ...)`` swaps in one with other settings on the same BMDB."""
    from shepherd.config import Settings
    from shepherd.runtime import Runtime
    from tasks import app

    settings = Settings(
        bmdb_url=pg_url, batch_size=10, in_flight_cap=3, dispatch_ttl=30,
        session_interval=2, first_heartbeat_timeout=1, heartbeat_timeout=1,
        callback_url=f"http://127.0.0.1:{free_port()}", healthz_timeout=0.5,
        reboots_per_hour=2, recovery_max_share=1.0)
    db = bmdb.connect(pg_url, thresholds=settings.thresholds)
    previous = app.runtime
    app.runtime = Runtime(settings, "test-worker", db=db, provider=UntouchableProvider())
    try:
        yield app.runtime
    finally:
        app.runtime.close()
        app.runtime = previous
        db.close()


def reconfigure(state, built_provider=None, **changes):
    """Swap the tasks' runtime for one with ``changes`` to its settings (same BMDB,
    ``built_provider`` or one built from the settings on first use)."""
    from shepherd.runtime import Runtime
    from tasks import app

    state.close()  # its session; the BMDB is the fixture's
    app.runtime = Runtime(dataclasses.replace(state.settings, **changes), state.component,
                          db=state.db, provider=built_provider)
    return app.runtime


def add_running(db: bmdb.BMDB, count: int, *, agent_started_ago: float | None = None
                ) -> list[uuid.UUID]:
    """Machines Provided and Running (the AgentStart backlog), or silent with an agent."""
    import datetime as dt

    from shepherd.providers.base import ProviderMachine, register_provided

    def body(tx: bmdb.Tx) -> list[uuid.UUID]:
        ids = []
        for i in range(count):
            machine = ProviderMachine(f"dev-{uuid.uuid4()}", f"127.9.0.{i + 1}", 22, None,
                                      None, bmdb.ProviderStatus.RUNNING, False)
            machine_id = register_provided(tx, "equinix", machine)
            if agent_started_ago is not None:
                started = tx.now - dt.timedelta(seconds=agent_started_ago)
                bmdb.set_agent_started(tx, machine_id, bytes(32), started_at=started)
            ids.append(machine_id)
        return ids

    with db.start_session("test-setup", interval=30) as session:
        return session.transact(body)


def test_sourcing_dispatches_claims_within_the_caps(state, monkeypatch) -> None:
    from tasks import app, control

    ids = add_running(state.db, 5)
    sent: list[dict] = []
    monkeypatch.setattr(app, "send_task",
                        lambda name, **kwargs: sent.append({"name": name, **kwargs}))

    first = control.source.run("ShepherdAgentStart")
    assert first == {"process": "ShepherdAgentStart", "claimed": 3, "dispatched": 3,
                     "refused": 0, "active": 0, "more": False}
    assert all(call["name"] == "shepherd.agent_start" and call["expires"] == 30
               and call["queue"] == "shepherd.machines" and call["ignore_result"]
               for call in sent)
    work = state.db.read(lambda tx: {(str(r.machine_id), str(r.id)) for r in
                                     tx.execute(bmdb._schema.work.select())})
    assert {tuple(call["args"]) for call in sent} == work
    assert {m for m, _ in work} <= {str(i) for i in ids}
    # Unadopted claims count against the in-flight cap.
    assert control.source.run("ShepherdAgentStart")["claimed"] == 0


@pytest.mark.parametrize(("cap", "runs"), [
    (10, [(2, True), (2, True), (1, False)]),  # the backlog ends in a short batch
    (3, [(2, True), (1, False), (0, False)]),  # the cap cuts the second batch short
])
def test_a_full_batch_sends_the_next_sourcing_at_once(state, monkeypatch, cap: int,
                                                      runs: list[tuple[int, bool]]) -> None:
    """Batches of two from five machines: a full batch with room under the cap sends
    the next sourcing at once; a short one leaves the rest to the beat."""
    from tasks import app, control

    reconfigure(state, batch_size=2, in_flight_cap=cap)
    add_running(state.db, 5)
    sent: list[tuple[str, dict]] = []
    monkeypatch.setattr(app, "send_task", lambda name, **kw: sent.append((name, kw)))

    results = [control.source.run("ShepherdAgentStart") for _ in runs]
    assert [(r["claimed"], r["more"]) for r in results] == runs
    followed = [kw for name, kw in sent if name == "shepherd.source"]
    assert [kw["args"] for kw in followed] == [("ShepherdAgentStart",)] * sum(
        more for _, more in runs)
    assert all(kw["expires"] == celeryconfig.MIN_EXPIRES for kw in followed)
    assert len(sent) - len(followed) == sum(claimed for claimed, _ in runs)


def test_a_broker_refusal_cancels_the_claim_at_once(state, monkeypatch) -> None:
    from kombu.connection import ConnectionPool

    from tasks import app, control

    ids = add_running(state.db, 2)
    monkeypatch.setitem(app.conf, "broker_url", f"redis://127.0.0.1:{free_port()}/0")
    monkeypatch.setitem(app.conf, "broker_connection_timeout", 0.5)
    monkeypatch.setitem(app.conf, "task_publish_retry_policy", {"max_retries": 1})
    try:
        result = control.source.run("ShepherdAgentStart")
    finally:
        # Celery.pool is kombu's ConnectionPool (celery-types says ProducerPool), kept in
        # Celery's private _pool: closed and forgotten, so that the next use connects anew.
        cast(ConnectionPool, app.pool).force_close_all()
        cast(Any, app)._pool = None
    assert result["claimed"] == 2 and result["refused"] == 2, result
    for machine_id in ids:  # the second was not even tried once the broker had refused
        history = state.db.read(lambda tx, m=machine_id: bmdb.machine_history(tx, m))
        assert [h["event"] for h in history] == ["Canceled", "Started"]
        assert history[0]["cause"].startswith("broker refused: OperationalError")
    assert state.db.read(lambda tx: tx.execute(bmdb._schema.work.select()).all()) == []
    assert state.db.read(lambda tx: tx.execute(bmdb._schema.backoff.select()).all()) == []


def test_a_redelivered_message_ends_as_gone_untouched(state) -> None:
    from tasks import machines

    [machine_id] = add_running(state.db, 1)
    [work] = state.session.claim_backlog(bmdb.Process.AGENT_START, 1, dispatch_ttl=30)
    state.session.adopt(work.id)  # the first delivery adopted it
    result = machines.agent_start.run(str(machine_id), str(work.id))
    assert result["outcome"] == "gone"


def test_recovery_pauses_at_execution_when_the_callback_server_is_down(state) -> None:
    from tasks import machines
    from tasks.errors import RecoveryPaused

    [machine_id] = add_running(state.db, 1, agent_started_ago=60)
    with state.db.start_session("sourcer", interval=30) as sourcer:
        [work] = sourcer.claim_backlog(bmdb.Process.RECOVERY, 1, dispatch_ttl=30)
        result = machines.recovery.run(str(machine_id), str(work.id))
    assert result["outcome"] == "paused" and "unreachable" in result["cause"], result
    history = state.db.read(lambda tx: bmdb.machine_history(tx, machine_id))
    assert [h["event"] for h in history] == ["Canceled", "Started"]
    assert "AgentStarted" in state.db.read(lambda tx: bmdb.machine_tags(tx, machine_id))
    with pytest.raises(RecoveryPaused, match="callback server"):
        machines.recovery.run(str(machine_id))  # by hand: refused, nothing claimed
    assert len(state.db.read(lambda tx: bmdb.machine_history(tx, machine_id))) == 2


def test_a_provider_that_cannot_be_built_fails_the_claim(state) -> None:
    """What the workflow needs can fail before it runs (here: the provider): the
    adopted claim is failed with a backoff, not left held by this live session."""
    from tasks import machines
    from tasks.errors import MachineWorkFailed

    state = reconfigure(state, provider="static")  # no inventory
    [machine_id] = add_running(state.db, 1)
    [work] = state.session.claim_backlog(bmdb.Process.AGENT_START, 1, dispatch_ttl=30)
    with pytest.raises(MachineWorkFailed, match="SHEPHERD_STATIC_INVENTORY"):
        machines.agent_start.run(str(machine_id), str(work.id))
    history = state.db.read(lambda tx: bmdb.machine_history(tx, machine_id))
    assert [h["event"] for h in history] == ["Failed", "Started"]
    assert history[0]["cause"].startswith("worker: SettingsError")
    assert state.db.read(lambda tx: tx.execute(bmdb._schema.work.select()).all()) == []
    assert len(state.db.read(lambda tx: tx.execute(bmdb._schema.backoff.select()).all())) == 1


@pytest.fixture
def healthy_callback_server(state):
    """A /healthz that answers 200, so only the share and the budget can pause Recovery."""
    from tests.support.operator_fixtures import healthy_callback_server as serving

    with serving() as url:
        reconfigure(state, UntouchableProvider(), callback_url=url)
        yield url


def test_sourcing_recovery_stays_within_the_hourly_budget(state, healthy_callback_server,
                                                          monkeypatch) -> None:
    from shepherd import metrics
    from tasks import app, control

    add_running(state.db, 3, agent_started_ago=60)  # three silent machines, budget of two
    sent: list[str] = []
    monkeypatch.setattr(app, "send_task", lambda name, **kw: sent.append(name))
    budget_pauses = metrics.RECOVERY_PAUSES.labels(reason="reboot_budget")
    before = budget_pauses._value.get()

    first = control.source.run("ShepherdRecovery")
    assert (first["claimed"], len(sent)) == (2, 2), first
    second = control.source.run("ShepherdRecovery")
    assert "reboots in the last hour" in second["paused"], second
    assert second["guard"]["causes"] == ["reboot_budget"]
    assert sent == ["shepherd.recovery"] * 2
    assert budget_pauses._value.get() == before + 1


def test_the_hourly_reboot_budget_counts_history_fleet_wide(state) -> None:
    import datetime as dt

    from shepherd import runtime
    from shepherd.workflows import guard

    machine_id, _ = add_running(state.db, 2, agent_started_ago=60)
    limits = dataclasses.replace(runtime.guard_limits(state.settings), healthz_url=None)

    def started(ago: float, work_id: uuid.UUID, event: str = bmdb.Event.STARTED) -> None:
        def body(tx: bmdb.Tx) -> None:
            tx.execute(bmdb._schema.history.insert().values(
                machine_id=machine_id, process="ShepherdRecovery", event=event,
                at=tx.now - dt.timedelta(seconds=ago), work_id=work_id))
        state.db.read(body)

    assert guard.evaluate(state.db, state.settings.thresholds, limits).allowed == 2
    started(7200, uuid.uuid4())      # over an hour ago: not counted
    canceled = uuid.uuid4()
    started(60, canceled)
    started(50, canceled, bmdb.Event.CANCELED)   # cancelled before rebooting: not counted
    started(30, uuid.uuid4())
    decision = guard.evaluate(state.db, state.settings.thresholds, limits)
    assert (decision.allowed, decision.reboots_last_hour, decision.paused) == (1, 1, None)
    started(10, uuid.uuid4())
    decision = guard.evaluate(state.db, state.settings.thresholds, limits)
    assert decision.allowed == 0 and "2 reboots in the last hour" in (decision.paused or "")
    unbudgeted = guard.evaluate(state.db, state.settings.thresholds, limits, budget=False)
    assert unbudgeted.paused is None


def test_settings_and_celery_config_from_the_environment() -> None:
    import celeryconfig
    from shepherd.config import Settings

    env = {"SHEPHERD_MAX_MACHINES": "7", "SHEPHERD_AGENT_ARGS": "--interval '0.5'",
           "SHEPHERD_RECOVERY_MAX_SHARE": "25%", "SHEPHERD_ASSIMILATE": "yes",
           "SHEPHERD_REBOOTS_PER_HOUR": "3", "SHEPHERD_SOURCE_INTERVAL": "2",
           "SHEPHERD_RECONCILE_INTERVAL": "0", "SHEPHERD_VISIBILITY_TIMEOUT": "7200",
           "SHEPHERD_BROKER_URL": "redis://127.0.0.1:1/3"}
    settings = Settings.from_env(env)
    assert (settings.max_machines, settings.agent_args, settings.recovery_max_share,
            settings.assimilate, settings.reboots_per_hour) == (7, ("--interval", "0.5"),
                                                                0.25, True, 3)
    config = celeryconfig.celery_settings(settings)
    assert config["broker_url"] == "redis://127.0.0.1:1/3"
    assert "reconcile" not in config["beat_schedule"]   # interval 0: off
    assert config["beat_schedule"]["source-recovery"] == {
        "task": "shepherd.source", "schedule": 2.0, "args": ("ShepherdRecovery",),
        "kwargs": {}, "options": {"expires": 10.0}}
    assert config["broker_transport_options"]["visibility_timeout"] == 7200
    limit = settings.machine_task_time_limit
    assert config["broker_transport_options"]["visibility_timeout"] > limit
    assert config["task_annotations"]["shepherd.agent_start"] == {
        "time_limit": limit, "soft_time_limit": limit - 30}
    install_limit = settings.install_task_time_limit
    assert config["broker_transport_options"]["visibility_timeout"] > install_limit
    assert config["task_annotations"]["shepherd.install"] == {
        "time_limit": install_limit, "soft_time_limit": install_limit - 60}
    assert config["task_acks_late"] and config["task_reject_on_worker_lost"]
    assert config["worker_prefetch_multiplier"] == 1


def test_the_tasks_app_configures_itself_from_one_settings(tmp_path) -> None:
    """Importing ``tasks`` reads nothing; the first configuration read builds the Celery
    config, beat's schedule and the runtime from the same ``Settings.from_env()``."""
    import os
    import subprocess
    import sys

    from tests.support.celery_fixtures import REPO

    env = {k: v for k, v in os.environ.items() if not k.startswith("SHEPHERD_")}
    env.update(SHEPHERD_BROKER_URL="redis://127.0.0.1:1/3", SHEPHERD_SOURCE_INTERVAL="2",
               SHEPHERD_RECONCILE_INTERVAL="0", SHEPHERD_BMDB_POOL_SIZE="3",
               SHEPHERD_BMDB_URL=f"sqlite:///{tmp_path / 'bmdb.sqlite'}")
    code = (
        "import json, os, tasks\n"
        "from tasks import app\n"
        "assert not app.configured\n"
        "schedule = app.conf.beat_schedule\n"
        "rt = app.runtime\n"
        "print(json.dumps({'broker': app.conf.broker_url, 'beat': sorted(schedule),\n"
        "    'every': schedule['source-recovery']['schedule'],\n"
        "    'interval': rt.settings.source_interval, 'pool': rt.settings.bmdb_pool_size,\n"
        "    'component': rt.component, 'pid': os.getpid()}))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["broker"] == "redis://127.0.0.1:1/3"
    assert seen["beat"] == ["bmc-sync", "prune-history", "source-agent-start",
                            "source-install", "source-recovery", "sweep", "update"]
    assert seen["every"] == seen["interval"] == 2.0
    assert seen["pool"] == 3
    assert seen["component"] == f"worker:{seen['pid']}"


def test_the_overlap_check_sees_two_holders() -> None:
    """The history replay the end-to-end tests rely on does find a double hold."""
    machine, first, second = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()

    def row(i: int, process: str, event: str, work: uuid.UUID) -> dict:
        return {"id": i, "machine_id": machine, "process": process, "event": event,
                "work_id": work}

    clean = [row(1, "ShepherdAgentStart", "Started", first),
             row(2, "ShepherdAgentStart", "Finished", first),
             row(3, "ShepherdRecovery", "Started", second),
             row(4, "ShepherdRecovery", "Abandoned", second)]
    assert overlapping_work(clean) == []
    clashing = [clean[0], row(2, "ShepherdRecovery", "Started", second), clean[1]]
    assert len(overlapping_work(clashing)) == 1


def test_reconcile_runs_once_at_a_time_fleet_wide(state) -> None:
    """Beat's reconcile skips at once; one by hand waits for the running one first."""
    from tasks import control

    with state.db.start_session("other-host", interval=30) as other, \
            bmdb.hold_singleton(other, "reconcile") as held:
        assert held
        assert control.reconcile.run(wait_for_running=0) == {
            "skipped": "reconcile already running"}
        started = time.monotonic()
        assert control.reconcile.run(wait_for_running=1.0) == {
            "skipped": "reconcile already running"}
        assert time.monotonic() - started >= 1.0


def _refused_worker(tmp_path, redis_url, as_nobody: bool = False, **env: str) -> str:
    """What a worker started with ``env`` printed; it must exit 2, as a refusal does.
    ``as_nobody``: as an unprivileged user, when we are root (root writes anywhere)."""
    import os
    import subprocess

    from tests.support.celery_fixtures import CELERY, REPO

    environ = {k: v for k, v in os.environ.items() if not k.startswith("SHEPHERD_")}
    environ.update(SHEPHERD_BROKER_URL=redis_url,
                   SHEPHERD_BMDB_URL=f"sqlite:///{tmp_path / 'bmdb.sqlite'}", **env)
    command = [CELERY, "-A", "tasks", "worker", "--loglevel=INFO"]
    if as_nobody and os.geteuid() == 0:
        command = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *command]
    result = subprocess.run(command, cwd=REPO, env=environ, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    return result.stdout + result.stderr


def test_a_worker_with_a_placeholder_prefix_refuses_to_start(tmp_path, redis_url) -> None:
    """One clear line and a non-zero exit, before any message is taken."""
    output = _refused_worker(tmp_path, redis_url, SHEPHERD_DEVICE_PREFIX="example-")
    assert "refuses to start: SHEPHERD_DEVICE_PREFIX 'example-' is empty or a placeholder" \
        in output


def test_a_worker_that_cannot_write_its_metrics_directory_refuses_to_start(
        tmp_path, redis_url) -> None:
    """As a restarted container whose tmpfs came back root-owned: one clear line, not a
    PermissionError (and a backoff) on every machine the worker is handed."""
    import os
    import shutil
    import tempfile

    metrics = tempfile.mkdtemp(prefix="shepherd-metrics-")  # outside root's tmp_path
    try:
        os.chmod(metrics, 0o555)
        output = _refused_worker(tmp_path, redis_url, as_nobody=True,
                                 PROMETHEUS_MULTIPROC_DIR=metrics)
    finally:
        shutil.rmtree(metrics)
    assert (f"refuses to start: PROMETHEUS_MULTIPROC_DIR={metrics} is not writable by this "
            "user") in output


def test_installations_are_sourced_within_their_own_cap_onto_their_queue(
        state, pg_url: str, monkeypatch) -> None:
    """Wanted installations of heartbeating machines are claimed at most
    ``install_in_flight_cap`` at a time fleet-wide (claims not yet adopted count), and
    sent to the installations' queue, never the machines' one."""
    from shepherd.runtime import Runtime
    from tasks import app, control

    ids = add_running(state.db, 3, agent_started_ago=5)

    def heard_and_wanted(tx: bmdb.Tx) -> None:
        for machine_id in ids:
            bmdb.record_heartbeat(tx, machine_id, tx.now)
            bmdb.want_installation(tx, machine_id, image="debian-12", disk="serial=S1",
                                   origin="operator", by="test", reason="sourcing")

    with state.db.start_session("test-setup", interval=30) as setup:
        setup.transact(heard_and_wanted)
    patient = bmdb.connect(pg_url, thresholds=bmdb.Thresholds(first_heartbeat=600,
                                                              heartbeat=600))
    state.close()
    app.runtime = Runtime(dataclasses.replace(state.settings, install_in_flight_cap=2),
                          state.component, db=patient, provider=UntouchableProvider())
    sent: list[dict] = []
    monkeypatch.setattr(app, "send_task",
                        lambda name, **kwargs: sent.append({"name": name, **kwargs}))
    try:
        first = control.source.run("ShepherdOSInstall")
        assert (first["claimed"], first["dispatched"]) == (2, 2), first
        assert {(call["name"], call["queue"]) for call in sent} == {
            ("shepherd.install", "shepherd.installations")}
        assert control.source.run("ShepherdOSInstall")["claimed"] == 0
    finally:
        app.runtime.close()
        patient.close()
