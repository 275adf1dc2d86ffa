"""Real racks end to end: machines listed in a static inventory, each an SSH server of
the simulator behind an emulated Redfish BMC (sushy-emulator, which no one here
wrote) whose power changes reach the machine; real Celery workers and beat on
PostgreSQL and Redis, all on loopback.

Each test runs the whole control plane for tens of seconds: marked slow.
"""

from __future__ import annotations

import functools
import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import bmdb
from shepherd.inventory.host_keys import key_line_fingerprint
from shepherd.providers import ssh_keys
from shepherd.simulator.racks import Racks
from shepherd.simulator.redfish import available as sushy_available
from tests.support.celery_fixtures import ControlPlane, overlapping_work
from tests.support.waiting import wait_until
from tests.support.workers import RACK_DEVICES

pytestmark = [
    pytest.mark.slow,
    RACK_DEVICES,
    pytest.mark.skipif(not sushy_available(), reason="sushy-tools is not installed"),
]
@pytest.fixture
def racked(control_plane: Callable[..., ControlPlane], tmp_path: Path
           ) -> Iterator[Callable[..., tuple[ControlPlane, Racks]]]:
    """``racked(count, **env)``: a control plane whose provider is the static inventory
    of ``count`` racked simulator machines (workers not started yet).

    Its first-heartbeat timeout is 30 s, not the plane's 5 s: these tests watch each
    BMC's resets, and on a loaded host a new agent's first heartbeat can take longer
    than 5 s, when Recovery would reset the machine before the test's scene begins."""
    started: list[Racks] = []

    def make(count: int, **env: str) -> tuple[ControlPlane, Racks]:
        directory = tmp_path / "racks"
        env = {"SHEPHERD_FIRST_HEARTBEAT_TIMEOUT": "30", **env}
        cp = control_plane(reservations=count, SHEPHERD_PROVIDER="static",
                           SHEPHERD_STATIC_INVENTORY=str(directory / "inventory.toml"),
                           SHEPHERD_RECOVERY_MAX_SHARE="1.0", **env)
        key = ssh_keys.load_or_create(cp.env["SHEPHERD_SSH_KEY_PATH"])
        racks = Racks(cp.simulator, directory, count,
                      authorized_keys=[ssh_keys.public_key_openssh(key)]).start()
        started.append(racks)
        return cp, racks

    yield make
    for racks in started:
        racks.stop()


def machine_of(cp: ControlPlane, name: str) -> uuid.UUID:
    [machine_id] = [m for m in cp.machine_ids() if cp.provider_id(m) == name]
    return machine_id


def rows(cp: ControlPlane, machine_id: uuid.UUID, event: str | None = None,
         process: str | None = None) -> list[dict]:
    return [h for h in cp.history() if h["machine_id"] == machine_id
            and (event is None or h["event"] == event)
            and (process is None or h["process"] == process)]


def heartbeating(cp: ControlPlane, machine_id: uuid.UUID, after: object = None) -> bool:
    beat = cp.tags(machine_id).get("AgentHeartbeat")
    return beat is not None and (after is None or beat["last_heartbeat_at"] > after)


def hold(cp: ControlPlane, machine_id: uuid.UUID, reason: str) -> None:
    with cp.db.start_session("test-operator", interval=30) as session:
        session.transact(lambda tx: bmdb.put_hold(tx, machine_id, bmdb.MAINTENANCE,
                                                   reason, "test"))


def test_a_racked_fleet_recovers_through_its_bmc(racked) -> None:
    """Four machines: one hangs (the ladder reboots it through its BMC), one loses only
    its agent (restarted, no reboot), one in maintenance hangs too (never touched),
    one presents another host key than its pin (nothing uploaded)."""
    cp, racks = racked(4, SHEPHERD_RUNG_TIMEOUT="25")
    hung, killed, resting, impostor = (m.id for m in racks.machines)
    stale_pin = cp.simulator.host_key_line(impostor)
    new_key = cp.simulator.rotate_host_key(impostor)
    cp.start_worker("w1", concurrency=3)
    cp.start_beat()
    cp.wait_for(lambda c: c.heartbeating == 3, timeout=60, what="3 machines heartbeating")
    ids = {name: machine_of(cp, name) for name in (hung, killed, resting, impostor)}

    # The impostor: refused before anything was uploaded, both keys named, backing off.
    [failed] = wait_until(lambda: rows(cp, ids[impostor], "Failed",
                                       bmdb.Process.AGENT_START.value)[-1:],
                          30, "the impostor's AgentStart to fail", cp)
    assert "host key mismatch" in failed["cause"]
    assert key_line_fingerprint(new_key) in failed["cause"]
    assert key_line_fingerprint(stale_pin) in failed["cause"]
    assert not any(cp.simulator.sandbox(impostor).glob("shepherd-agent*"))
    assert "AgentStarted" not in cp.tags(ids[impostor])
    [held] = host_key_holds(cp, ids[impostor])
    assert held.host_key == new_key and key_line_fingerprint(stale_pin) in held.reason

    hold(cp, ids[resting], "disk swap")
    started = time.time()
    cp.simulator.hang(hung)
    cp.simulator.hang(resting)
    cp.simulator.kill_agent(killed)

    def finished(name: str) -> dict | None:
        done = rows(cp, ids[name], "Finished", bmdb.Process.RECOVERY.value)
        return done[-1] if done else None

    done_hung = wait_until(lambda: finished(hung), 90, "Recovery of the hung machine", cp)
    done_killed = wait_until(lambda: finished(killed), 60, "Recovery of the dead agent", cp)
    wait_until(lambda: heartbeating(cp, ids[hung], done_hung["at"]), 60,
               "heartbeats from the rebooted machine", cp)
    wait_until(lambda: heartbeating(cp, ids[killed], done_killed["at"]), 30,
               "heartbeats from the restarted agent", cp)

    # The hung machine: rung 0 failed (no SSH), rung 1 was seen to power-cycle it.
    rungs = [r["cause"] for r in rows(cp, ids[hung], "Rung")]
    assert rungs[0].startswith("rung 0 (agent restart): not verified")
    assert rungs[1].startswith("rung 1 (graceful restart): verified")
    # The evidence: power seen leaving On and coming back, or (when the emulator's
    # Off lasted less than one poll, which its fake driver allows) SSH answering
    # again on the machine that was hung before the reset.
    assert re.search(r": power (On -> )?Off -> On$|: SSH banner (went away|was away before "
                     r"the reset) and came back", rungs[1]), rungs[1]
    assert racks.bmc.resets(hung) == ["GracefulRestart"]
    assert cp.simulator.devices[hung].power_changes >= 2
    assert rows(cp, ids[hung], "Finished", bmdb.Process.AGENT_START.value)[-1]["at"] \
        > done_hung["at"]
    # The dead agent: restarted over SSH, its machine never power-cycled.
    [restart] = [r["cause"] for r in rows(cp, ids[killed], "Rung")]
    assert restart.startswith("rung 0 (agent restart): verified")
    assert racks.bmc.resets(killed) == [] and cp.simulator.devices[killed].power_changes == 0
    # The machine in maintenance: silent all along, never claimed, never reset. Give
    # Recovery its chance first: past the heartbeat timeout (3 s) plus several
    # sourcing rounds (0.5 s), however fast the other two recovered.
    time.sleep(max(0.0, started + 5 - time.time()))
    assert rows(cp, ids[resting], process=bmdb.Process.RECOVERY.value) == []
    assert racks.bmc.resets(resting) == [] and cp.simulator.devices[resting].hung
    assert overlapping_work(cp.history()) == []
    assert cp.log_problems("w1", "beat") == []


class Baseline:
    """Resets and power changes each machine had when the test's scene began, so that
    only the scene's own are judged."""

    def __init__(self, cp: ControlPlane, racks: Racks, *names: str) -> None:
        assert racks.bmc is not None
        self.cp, self.bmc = cp, racks.bmc
        self.resets = {name: len(self.bmc.resets(name)) for name in names}
        self.power = {name: cp.simulator.devices[name].power_changes for name in names}

    def new_resets(self, name: str) -> list[str]:
        return self.bmc.resets(name)[self.resets[name]:]

    def untouched(self, name: str) -> bool:
        return (self.new_resets(name) == []
                and self.cp.simulator.devices[name].power_changes == self.power[name])


def host_key_holds(cp: ControlPlane, machine_id: uuid.UUID) -> list[bmdb.Hold]:
    return cp.db.read(lambda tx: bmdb.holds_of(tx, machine_id, bmdb.HOST_KEY_HOLD))


def test_a_machine_reinstalled_behind_shepherds_back_is_held_then_accepted(racked) -> None:
    """Its agent gone and SSH answering with a new host key: Recovery's rung 0 fails on
    the mismatch, nothing is reset, and the machine is held with both fingerprints.
    The one documented step, ``shepherd host-key accept NAME --reason``, pins the key
    it met and lets it go: rung 0 then restarts the agent, still with no reset."""
    cp, racks = racked(2)
    reinstalled, other = (m.id for m in racks.machines)
    cp.start_worker("w1", concurrency=2)
    cp.start_beat()
    cp.wait_for(lambda c: c.heartbeating == 2, timeout=60, what="2 machines heartbeating")
    machine = machine_of(cp, reinstalled)
    baseline = Baseline(cp, racks, reinstalled, other)
    pinned = cp.simulator.host_key_line(reinstalled)
    assert cp.simulator.kill_agent(reinstalled) >= 1
    new_key = cp.simulator.rotate_host_key(reinstalled)

    [held] = wait_until(lambda: host_key_holds(cp, machine), 60, "the host-key hold", cp)
    assert held.host_key == new_key and held.kind == bmdb.HOST_KEY_HOLD
    for key in (pinned, new_key):
        assert key_line_fingerprint(key) in held.reason, held.reason
    failed = rows(cp, machine, "Failed", bmdb.Process.RECOVERY.value)[-1]
    assert "no reset tried" in failed["cause"] and "held until" in failed["cause"]
    assert baseline.untouched(reinstalled)
    shown = cp.cli("python", "-m", "shepherd.cli", "show", reinstalled)
    assert f"shepherd host-key accept {machine} --reason TEXT" in shown.stdout, shown.stdout

    finished_before = len(rows(cp, machine, "Finished", bmdb.Process.RECOVERY.value))
    accepted = cp.cli("python", "-m", "shepherd.cli", "host-key", "accept", reinstalled,
                      "--reason", "reinstalled by hand", "--by", "alice")
    assert accepted.returncode == 0, accepted.stderr
    assert f"host key {key_line_fingerprint(new_key)} pinned" in accepted.stdout
    again = cp.cli("python", "-m", "shepherd.cli", "host-key", "accept", reinstalled,
                   "--reason", "twice")
    assert again.returncode == 1 and "not held for a host-key mismatch" in again.stderr

    def restarted() -> dict | None:
        done = rows(cp, machine, "Finished", bmdb.Process.RECOVERY.value)[finished_before:]
        return done[-1] if done else None

    finished = wait_until(restarted, 60, "Recovery of the accepted machine", cp)
    wait_until(lambda: heartbeating(cp, machine, finished["at"]), 30,
               "heartbeats from the restarted agent", cp)
    rungs = [r["cause"] for r in rows(cp, machine, "Rung")]
    assert rungs[-1].startswith("rung 0 (agent restart): verified"), rungs
    assert baseline.untouched(reinstalled)
    assert host_key_holds(cp, machine) == []
    pin = cp.db.read(lambda tx: bmdb.recorded_host_key(tx, machine))
    assert pin is not None and (pin.host_key, pin.source) == (new_key, bmdb.OPERATOR_PIN)
    history = [r["cause"] for r in rows(cp, machine, process="HostKey")]
    assert f"accepted by alice: {key_line_fingerprint(new_key)}" in history, history
    assert "by alice: reinstalled by hand" in history, history
    assert baseline.untouched(other)


def test_a_worker_killed_right_after_a_reset_leaves_it_in_history_and_no_second(
        racked) -> None:
    """The BMC acknowledges resets without acting (frozen), so the ladder's first rung
    is still watching when the worker is killed, as soon as the BMC has the reset.
    History shows that reset (its intent was recorded before the call), and the next
    attempt, on another worker, sends none within the rung's timeout: it fails saying
    why and backs off. Checked from the BMC's own log of resets."""
    cp, racks = racked(1, SHEPHERD_RUNG_TIMEOUT="40")
    (name,) = (m.id for m in racks.machines)
    recovery = bmdb.Process.RECOVERY.value
    cp.start_worker("w1", concurrency=1)
    cp.start_beat()
    cp.wait_for(lambda c: c.heartbeating == 1, timeout=60, what="1 machine heartbeating")
    machine = machine_of(cp, name)
    baseline = Baseline(cp, racks, name)
    asked_before = len(rows(cp, machine, "Asked", "Power"))
    racks.bmc.set_frozen(name)
    cp.simulator.hang(name)
    wait_until(lambda: baseline.new_resets(name), 90, "the first reset at the BMC", cp)
    cp.kill("w1")
    killed_at = time.monotonic()
    before_kill = len(rows(cp, machine, process=recovery))
    cp.start_worker("w2", concurrency=1)

    def refused() -> dict | None:
        failed = [r for r in rows(cp, machine, process=recovery)[before_kill:]
                  if r["event"] == "Failed" and "no second reset before" in r["cause"]]
        return failed[0] if failed else None

    failure = wait_until(refused, 35, "the next attempt refusing a second reset", cp)
    assert time.monotonic() - killed_at < 40  # still within the rung's timeout
    assert baseline.new_resets(name) == ["GracefulRestart"]
    assert "graceful_restart was asked of redfish" in failure["cause"]
    [asked] = rows(cp, machine, "Asked", "Power")[asked_before:]
    assert asked["cause"].startswith("graceful_restart of redfish"), asked
    events = [(r["event"], r["cause"]) for r in rows(cp, machine, process=recovery)]
    after_kill = [event for event, _ in events[before_kill:]]
    assert "Abandoned" in after_kill and after_kill[-1] == "Failed", events
    assert not [r for r in rows(cp, machine, "Rung") if r["cause"].startswith("rung 1")]
    shown = cp.cli("python", "-m", "shepherd.cli", "show", name)
    assert "graceful_restart of redfish" in shown.stdout, shown.stdout


def swap_bmcs(racks: Racks, one: str, other: str) -> str:
    """Swap the two machines' BMC systems in the inventory (a pair of lines typed the
    wrong way round); returns the inventory as it was."""
    before, bmc = racks.inventory_path.read_text(), racks.bmc
    assert bmc is not None
    a, b = (f'bmc = {{ system = "{bmc.system_path(name)}" }}' for name in (one, other))
    racks.inventory_path.write_text(before.replace(a, "@swap@").replace(b, a)
                                    .replace("@swap@", b))
    return before


def test_a_swapped_pair_of_inventory_lines_holds_both_and_resets_neither(racked) -> None:
    """Two machines' BMC lines swapped. The hung one's Recovery reads its BMC's system
    UUID, which is the other machine's DMI UUID: held, no reset through the wrong BMC.
    ``shepherd power cycle`` of the other is refused with both identities and holds it
    too. Once the inventory is fixed and the holds cleared, the ladder resets the right
    system. Every reset checked in the BMC's own log."""
    cp, racks = racked(2, SHEPHERD_RUNG_TIMEOUT="20")
    hung, healthy = (m.id for m in racks.machines)
    cp.start_worker("w1", concurrency=2)
    cp.start_beat()
    cp.wait_for(lambda c: c.heartbeating == 2, timeout=60, what="2 machines heartbeating")
    ids = {name: machine_of(cp, name) for name in (hung, healthy)}
    baseline = Baseline(cp, racks, hung, healthy)
    fixed = swap_bmcs(racks, hung, healthy)
    cp.simulator.hang(hung)

    def mismatch_holds(name: str) -> list[bmdb.Hold]:
        return cp.db.read(lambda tx: bmdb.holds_of(tx, ids[name], bmdb.BMC_MISMATCH_HOLD))

    [held] = wait_until(lambda: mismatch_holds(hung), 60, "the hung machine held", cp)
    assert "the BMC manages uuid" in held.reason and "the machine reports uuid" in held.reason
    # The hold is committed before the failure that follows it: wait for that too.
    failed = wait_until(lambda: rows(cp, ids[hung], "Failed", bmdb.Process.RECOVERY.value)[-1:],
                        30, "the Recovery failure after the hold", cp)[0]
    assert "BmcMismatch" in failed["cause"], failed
    refused = cp.cli("python", "-m", "shepherd.cli", "power", "cycle", healthy)
    assert refused.returncode != 0 and "the BMC manages uuid" in refused.stderr, refused
    [other] = mismatch_holds(healthy)
    assert "the BMC manages uuid" in other.reason
    for name in (hung, healthy):
        assert baseline.untouched(name), name
    shown = cp.cli("python", "-m", "shepherd.cli", "show", hung)
    assert "held on a BMC mismatch" in shown.stdout
    assert f"shepherd bmc-mismatch clear {ids[hung]} --reason TEXT" in shown.stdout

    finished_before = len(rows(cp, ids[hung], "Finished", bmdb.Process.RECOVERY.value))
    racks.inventory_path.write_text(fixed)
    for name in (hung, healthy):
        cleared = cp.cli("python", "-m", "shepherd.cli", "bmc-mismatch", "clear", name,
                         "--reason", "inventory lines were swapped")
        assert cleared.returncode == 0, cleared.stderr
    cp.cli("python", "-m", "shepherd.cli", "clear-backoff", hung, "recovery")

    def recovered() -> dict | None:
        done = rows(cp, ids[hung], "Finished", bmdb.Process.RECOVERY.value)[finished_before:]
        return done[-1] if done else None

    wait_until(recovered, 90, "Recovery through the right BMC", cp)
    assert baseline.new_resets(hung) == ["GracefulRestart"]
    assert baseline.new_resets(healthy) == []
    checks = [r["cause"] for r in rows(cp, ids[hung], "BmcIdentity")]
    assert checks and checks[-1].startswith("the BMC and the machine agree on uuid"), checks
    assert mismatch_holds(hung) == mismatch_holds(healthy) == []


def test_a_bmc_that_never_acts_quarantines_and_a_wrong_password_backs_off(racked) -> None:
    """A BMC that acknowledges resets but never changes power: the ladder is exhausted,
    twice, then the machine is quarantined and left alone. A wrong BMC password: a
    cause naming the BMC, a backoff, and the password nowhere."""
    cp, racks = racked(2, SHEPHERD_RUNG_TIMEOUT="2", SHEPHERD_QUARANTINE_AFTER="2",
                       SHEPHERD_BOOT_WAIT="2")
    frozen, locked_out = (m.id for m in racks.machines)
    wrong = racks.directory / "wrong-password"
    wrong.write_text("not-the-bmc-password\n")
    wrong.chmod(0o600)
    inventory = racks.inventory_path.read_text()
    system = racks.bmc.system_path(locked_out)
    racks.inventory_path.write_text(inventory.replace(
        f'bmc = {{ system = "{system}" }}',
        f'bmc = {{ system = "{system}", password_file = "{wrong}" }}'))
    racks.bmc.set_frozen(frozen)
    cp.start_worker("w1", concurrency=2)
    cp.start_beat()
    cp.wait_for(lambda c: c.heartbeating == 2, timeout=60, what="2 machines heartbeating")
    ids = {name: machine_of(cp, name) for name in (frozen, locked_out)}
    cp.simulator.hang(frozen)
    cp.simulator.hang(locked_out)

    def quarantined() -> bool:
        return any(r["event"] == "Held" for r in rows(cp, ids[frozen], process="Quarantine"))

    wait_until(quarantined, 90, "the frozen machine quarantined", cp)
    failures = rows(cp, ids[frozen], "Failed", bmdb.Process.RECOVERY.value)
    assert len(failures) == 2
    assert all(f["cause"].startswith("ladder exhausted") for f in failures)
    rungs = [r["cause"][:28] for r in rows(cp, ids[frozen], "Rung")]
    assert rungs.count("rung 3 (power off, then on):") == 2
    resets_at_quarantine = len(racks.bmc.resets(frozen))
    assert resets_at_quarantine == 2 * 3  # graceful, force, off: twice; never on

    bad = wait_until(lambda: rows(cp, ids[locked_out], "Failed",
                                  bmdb.Process.RECOVERY.value), 30, "the refused login", cp)
    assert "BmcAuthFailed" in bad[0]["cause"] and racks.bmc.base_url in bad[0]["cause"]
    assert racks.bmc.resets(locked_out) == []
    with cp.db.start_session("test-reader", interval=30) as session:
        backoffs = session.transact(
            lambda tx: bmdb.machine_backoffs(tx, ids[locked_out]))
    assert any(b.process == bmdb.Process.RECOVERY.value for b in backoffs)

    # Quarantined: nothing more is done to it, however long it stays silent.
    time.sleep(6)
    assert len(rows(cp, ids[frozen], "Failed", bmdb.Process.RECOVERY.value)) == 2
    assert len(racks.bmc.resets(frozen)) == resets_at_quarantine
    password = racks.password_path.read_text().strip()
    for name in ("w1", "beat"):
        assert password not in cp.log(name)
        assert "not-the-bmc-password" not in cp.log(name)
    assert all(password not in (h["cause"] or "") for h in cp.history())
    assert overlapping_work(cp.history()) == []


def bmc_booked(cp: ControlPlane, machine_id: uuid.UUID) -> bmdb.BmcSync | None:
    return cp.db.read(lambda tx: bmdb.bmc_sync_of(tx, machine_id))


def not_answering_gauge(cp: ControlPlane, status: str) -> float:
    from shepherd.metrics import BMDBCollector

    [family] = [f for f in BMDBCollector(cp.db).collect()
                if f.name == "shepherd_bmcs_not_answering"]
    return next(s.value for s in family.samples if s.labels["status"] == status)


def test_the_sync_reads_every_bmc_and_marks_one_that_stops_answering(racked) -> None:
    """The power and health sync through the workers and beat: every racked BMC read
    within its interval, its power and health in ``show`` and ``machines``; the BMC
    hung (SIGSTOP): unreachable in ``show`` and ``/metrics``'s gauge, and Recovery of a
    machine behind it stops before its ladder; the BMC back: cleared by the sync alone."""
    cp, racks = racked(2, SHEPHERD_BMC_SYNC_INTERVAL="2", SHEPHERD_BMC_SYNC_TICK="1",
                       SHEPHERD_BMC_TIMEOUT="2", SHEPHERD_BMC_ATTEMPTS="1",
                       SHEPHERD_BMC_SLOW="1.5", SHEPHERD_BMC_CALLS_RESERVED="2")
    hung, other = (m.id for m in racks.machines)
    cp.start_worker("w1", concurrency=3)
    cp.start_beat()
    cp.wait_for(lambda c: c.heartbeating == 2, timeout=60, what="2 machines heartbeating")
    ids = {name: machine_of(cp, name) for name in (hung, other)}

    def has_status(name: str, status: str) -> bool:
        found = bmc_booked(cp, ids[name])
        return found is not None and found.read_at is not None and found.status == status

    for name in (hung, other):
        wait_until(functools.partial(has_status, name, "answering"), 30, f"{name} read", cp)
    shown = cp.cli("python", "-m", "shepherd.cli", "show", hung).stdout
    assert "sync: BMC answering" in shown and "health OK" in shown, shown
    listed = cp.cli("python", "-m", "shepherd.cli", "machines").stdout
    assert "POWER" in listed and "On · " in listed, listed

    assert racks.bmc is not None
    racks.bmc.pause()
    try:
        for name in (hung, other):
            wait_until(functools.partial(has_status, name, "unreachable"), 30,
                       f"{name}'s BMC marked unreachable", cp)
        assert not_answering_gauge(cp, "unreachable") == 2
        shown = cp.cli("python", "-m", "shepherd.cli", "show", hung).stdout
        assert "LOOK: BMC unreachable" in shown, shown
        cp.simulator.hang(hung)
        failed = wait_until(lambda: rows(cp, ids[hung], "Failed",
                                         bmdb.Process.RECOVERY.value)[-1:], 60,
                            "Recovery to stop before its ladder", cp)[0]
        assert "the power and health sync found" in failed["cause"], failed
        rungs = [r["cause"] for r in rows(cp, ids[hung], "Rung")]
        assert rungs and all(r.startswith("rung 0 (agent restart)") for r in rungs), rungs
    finally:
        racks.bmc.resume()
    for name in (hung, other):
        wait_until(functools.partial(has_status, name, "answering"), 30,
                   f"{name}'s BMC answering again", cp)
    assert not_answering_gauge(cp, "unreachable") == 0
    assert cp.log_problems("beat") == []
