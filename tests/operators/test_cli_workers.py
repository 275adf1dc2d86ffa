"""``shepherd reconcile`` and ``shepherd start`` through the broker: the CLI as a
subprocess, a real Redis broker and a real ``celery worker`` that adopts the claims.
The CLI sends tasks by name, as ``shepherd.task_api`` declares them (whose own tests
check the declarations against the tasks the workers register)."""

from __future__ import annotations

import json
import socket
import time

import pytest

import bmdb

pytestmark = pytest.mark.timeout(180)


@pytest.mark.slow
def test_reconcile_and_start_hand_over_to_a_worker(control_plane) -> None:
    # No periodic reconcile or sourcing: whatever happens is what the CLI asked for.
    cp = control_plane(reservations=2, SHEPHERD_RECONCILE_INTERVAL="0",
                       SHEPHERD_SOURCE_INTERVAL="0")
    cp.start_worker("w1")
    cp.start_beat()  # update (provider status) and sweep only

    done = cp.cli("python", "-m", "shepherd.cli", "reconcile", timeout=90)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("reconcile: {")
    cp.wait_for(lambda c: c.backlog[bmdb.Process.AGENT_START.value] == 2, timeout=60,
                what="both machines in the AgentStart backlog")

    machine, other = sorted(cp.machine_ids())
    started = cp.cli("python", "-m", "shepherd.cli", "start", "agent-start", str(machine),
                     "--wait", "30", timeout=90)
    assert started.returncode == 0, started.stderr
    assert f"ShepherdAgentStart started on machine {machine}: work " in started.stdout
    assert ", task " in started.stdout  # the Celery task id

    cp.wait_for(lambda c: c.agent_started == 1, timeout=60, what="the agent started")
    assert "AgentStarted" in cp.tags(machine)
    time.sleep(1)
    assert "AgentStarted" not in cp.tags(other)
    events = [(r["event"], r["session_id"]) for r in cp.history()
              if r["machine_id"] == machine and r["process"] == bmdb.Process.AGENT_START]
    assert [e for e, _ in events] == [bmdb.Event.STARTED, bmdb.Event.FINISHED]
    # Claimed by the CLI's session, finished by the worker session that adopted it.
    assert events[0][1] != events[1][1]
    assert cp.log_problems("w1") == []

    fleet = cp.cli("python", "-m", "shepherd.cli", "fleet", "--json")
    assert json.loads(fleet.stdout)["agent_started"] == 1


def test_reconcile_without_a_worker_fails_in_bounded_time(control_plane) -> None:
    cp = control_plane(reservations=1, SHEPHERD_RECONCILE_WAIT="2")
    began = time.monotonic()
    done = cp.cli("python", "-m", "shepherd.cli", "reconcile", timeout=60)
    assert done.returncode == 1
    assert "no result from reconcile task" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert time.monotonic() - began < 30


def test_start_without_a_worker_cancels_its_claim(control_plane) -> None:
    cp = control_plane(reservations=1, SHEPHERD_RECONCILE_INTERVAL="0",
                       SHEPHERD_SOURCE_INTERVAL="0")
    cp.start_worker("w1")
    cp.start_beat()  # update (the machine's provider status) and sweep only
    assert cp.cli("python", "-m", "shepherd.cli", "reconcile", timeout=90).returncode == 0
    (machine,) = cp.machine_ids()
    cp.wait_for(lambda c: c.backlog[bmdb.Process.AGENT_START.value] == 1, timeout=60,
                what="the machine in the AgentStart backlog")
    cp.stop("w1")  # nobody takes the task any more
    done = cp.cli("python", "-m", "shepherd.cli", "start", "agent-start", str(machine),
                  "--wait", "1", timeout=60)
    assert done.returncode == 1, done.stderr
    assert "no worker took ShepherdAgentStart within 1s" in done.stderr
    assert [r["event"] for r in cp.history() if r["machine_id"] == machine] == [
        bmdb.Event.STARTED, bmdb.Event.CANCELED]


def test_an_unreachable_broker_is_one_line(control_plane) -> None:
    with socket.socket() as closed:  # bound, not listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        broker = f"redis://127.0.0.1:{closed.getsockname()[1]}/0"
        cp = control_plane(reservations=1, SHEPHERD_BROKER_URL=broker,
                           SHEPHERD_RESULT_BACKEND=broker)
        began = time.monotonic()
        done = cp.cli("python", "-m", "shepherd.cli", "reconcile", timeout=90)
    assert done.returncode == 1
    assert done.stderr.startswith("shepherd reconcile: reconcile failed: "), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert time.monotonic() - began < 60
