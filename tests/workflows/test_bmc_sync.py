"""The power and health sync against BMCs no one here wrote (sushy-emulator, OpenIPMI's
ipmi_sim), on a real BMDB: what one read records, the budget (one call per BMC, a cap
fleet-wide with slots left to Recovery, one read per interval), and the BMCs that stop
answering, change their password or answer slowly: each shown, counted for the alert,
known to Recovery, and cleared by the next answer. Every count of calls in flight is
read from the emulators' own request logs."""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import pytest

import bmdb
from shepherd import power
from shepherd.bmc import BmcSpec
from shepherd.inventory.provider import StaticProvider
from shepherd.providers.base import register_provided
from shepherd.simulator.redfish import peak_in_flight
from shepherd.workflows import bmc_sync, recoverer
from shepherd.workflows.common import WorkflowFailure
from tests.support.bmc_fixtures import IpmiBmc, RedfishBmc, running_redfish

pytestmark = pytest.mark.timeout(120)

#: ``slow`` as long as a read may take: only the slow BMC's test (its own setting) wants
#: "slow"; elsewhere a read that a loaded host stretched past 5 s still answered.
SETTINGS = bmc_sync.SyncSettings(interval=60, tick=10, calls_cap=4, reserved=1, slow=30.0,
                                 heartbeat_timeout=600)


def connect(spec: BmcSpec) -> power.BmcControl:
    """One attempt with room for a loaded host: an IPMI survey starts a helper process
    and several reads, which took over 3 s on a busy 2-core machine."""
    return power.connect(spec, timeout=30.0, attempts=1)


BRIEF_TIMEOUT = 3.0


def connect_briefly(spec: BmcSpec) -> power.BmcControl:
    """Short bounds, for the runs where a BMC is down: found within seconds."""
    return power.connect(spec, timeout=BRIEF_TIMEOUT, attempts=1)


@dataclass
class Rack:
    provider: StaticProvider
    #: Inventory id -> BMDB machine id.
    ids: dict[str, uuid.UUID]

    def id(self, name: str) -> uuid.UUID:
        return self.ids[name]


def redfish_table(bmc: RedfishBmc, system: str) -> str:
    return (f'{{ driver = "redfish", address = "{bmc.address}", username = "admin", '
            f'password_file = "{bmc.password_file}", '
            f'system = "{bmc.emulator.system_path(system)}" }}')


def ipmi_table(bmc: IpmiBmc) -> str:
    spec = bmc.spec()
    return (f'{{ driver = "ipmi", address = "{spec.address}", port = {spec.port}, '
            f'username = "{spec.username}", password_file = "{spec.password_file}" }}')


def rack_of(session: bmdb.Session, path: Path, entries: Sequence[tuple[str, str]]) -> Rack:
    """An inventory file listing ``(id, bmc table)``, and its machines registered."""
    lines = []
    for number, (name, table) in enumerate(entries):
        # No SSH is asked here: a distinct unused loopback address each.
        lines += ["[[machines]]", f'id = "{name}"', f'address = "127.0.9.{number + 1}"',
                  f"bmc = {table}"]
    path.write_text("\n".join(lines) + "\n")
    provider = StaticProvider(path)

    def register(tx: bmdb.Tx) -> dict[str, uuid.UUID]:
        return {m.provider_id: register_provided(tx, provider.name, m)
                for m in provider.list_machines()}

    return Rack(provider, session.transact(register))


def redfish_rack(session: bmdb.Session, tmp_path: Path, bmc: RedfishBmc,
                 entries: Sequence[tuple[str, str]]) -> Rack:
    """``(id, system name)`` of one emulated Redfish BMC."""
    return rack_of(session, tmp_path / "inventory.toml",
                   [(name, redfish_table(bmc, system)) for name, system in entries])


def read_all_now(session: bmdb.Session, rack: Rack,
                 settings: bmc_sync.SyncSettings = SETTINGS) -> bmc_sync.SyncResult:
    """Book the rack with every first read due now, then run the sync once."""
    bmc_sync.enroll(session, rack.ids.values(), 0)
    return bmc_sync.sync(session, rack.provider, settings, connect)


def booked(session: bmdb.Session, machine_id: uuid.UUID) -> bmdb.BmcSync:
    found = session.db.read(lambda tx: bmdb.bmc_sync_of(tx, machine_id))
    assert found is not None
    return found


def make_due(session: bmdb.Session, rack: Rack) -> None:
    """Every booked read due now (as if the interval had passed)."""
    for machine_id in rack.ids.values():
        session.transact(functools.partial(bmdb.postpone_bmc_read, machine_id=machine_id,
                                           seconds=0))


def bmc_history(session: bmdb.Session, machine_id: uuid.UUID) -> list[str]:
    rows = session.db.read(lambda tx: bmdb.machine_history(tx, machine_id))
    return [row["cause"] for row in reversed(rows) if row["process"] == "Bmc"]


@pytest.fixture
def redfish(tmp_path: Path) -> Iterator[RedfishBmc]:
    with running_redfish(tmp_path / "redfish", (("node-1", "On"), ("node-2", "Off"))) as bmc:
        yield bmc


def test_one_read_records_power_and_health_and_none_comes_before_the_interval(
        session: bmdb.Session, redfish: RedfishBmc, tmp_path: Path) -> None:
    rack = redfish_rack(session, tmp_path, redfish, [("u1", "node-1"), ("u2", "node-2")])
    began = time.time()
    result = read_all_now(session, rack)
    assert (result.answered, result.failed, result.busy) == (2, 0, 0)
    for name, state in (("u1", "On"), ("u2", "Off")):
        found = booked(session, rack.id(name))
        assert (found.status, found.health, found.problem) == ("answering", "OK", None)
        assert found.read_at is not None and found.answer_seconds is not None
        seen = session.db.read(functools.partial(bmdb.power_of, machine_id=rack.id(name)))
        assert seen is not None and seen.state == state and seen.observed_at is not None
        assert found.due_at - found.read_at >= dt.timedelta(seconds=SETTINGS.interval - 1)
    reads = [r for r in redfish.emulator.requests() if r.start >= began]
    assert sorted(r.path for r in reads if "Systems/" in r.path) == sorted(
        redfish.emulator.system_path(n) for n in ("node-1", "node-2"))
    # The interval has not passed: a second run reads nothing.
    again = bmc_sync.sync(session, rack.provider, SETTINGS, connect)
    assert (again.answered, again.failed) == (0, 0)
    assert len([r for r in redfish.emulator.requests() if r.start >= began]) == len(reads)


def test_a_bmc_that_stops_answering_is_marked_known_to_recovery_and_clears_itself(
        session: bmdb.Session, redfish: RedfishBmc, tmp_path: Path) -> None:
    rack = redfish_rack(session, tmp_path, redfish, [("u1", "node-1"), ("u2", "node-2")])
    machine = rack.id("u1")
    read_all_now(session, rack)
    redfish.emulator.pause()
    try:
        make_due(session, rack)
        started = time.monotonic()
        result = bmc_sync.sync(session, rack.provider, SETTINGS, connect_briefly)
        assert result.failed == 2
        # One call waited out the timeout; the other machine behind that BMC was not
        # asked, so the run took one timeout, not two.
        assert time.monotonic() - started < 2 * BRIEF_TIMEOUT
        problems = [booked(session, rack.id(n)).problem or "" for n in ("u1", "u2")]
        assert sum("not asked: it did not answer" in p for p in problems) == 1, problems
        found = booked(session, machine)
        assert found.status == "unreachable" and "BmcUnreachable" in (found.problem or "")
        assert found.health == "OK"  # the last answered read's, kept with its time
        counts = session.db.read(bmdb.bmc_sync_counts)
        assert counts.by_status["unreachable"] == 2
        work = SimpleNamespace(session=session, machine_id=machine)
        inventory_entry = rack.provider.get_machine("u1")
        with pytest.raises(WorkflowFailure, match=r"unreachable since .* no reset is tried"):
            recoverer.refuse_a_bmc_not_answering(work, inventory_entry)  # type: ignore[arg-type]
    finally:
        redfish.emulator.resume()
    make_due(session, rack)
    assert bmc_sync.sync(session, rack.provider, SETTINGS, connect).answered == 2
    assert booked(session, machine).status == "answering"
    assert session.db.read(bmdb.bmc_sync_counts).by_status["unreachable"] == 0
    recoverer.refuse_a_bmc_not_answering(work, inventory_entry)  # type: ignore[arg-type]
    history = bmc_history(session, machine)
    assert [h.split(":")[0] for h in history] == ["unreachable (was answering)",
                                                   "answering (was unreachable)"]


def test_a_changed_password_is_auth_refused_until_the_inventory_has_the_new_one(
        session: bmdb.Session, redfish: RedfishBmc, tmp_path: Path) -> None:
    rack = redfish_rack(session, tmp_path, redfish, [("u1", "node-1")])
    machine = rack.id("u1")
    read_all_now(session, rack)
    redfish.emulator.set_password("rotated-" + redfish.password)
    make_due(session, rack)
    bmc_sync.sync(session, rack.provider, SETTINGS, connect)
    found = booked(session, machine)
    assert found.status == "auth-refused" and "HTTP 401" in (found.problem or "")
    assert redfish.password not in (found.problem or "")
    assert session.db.read(bmdb.bmc_sync_counts).by_status["auth-refused"] == 1
    redfish.password_file.write_text("rotated-" + redfish.password + "\n")
    make_due(session, rack)
    bmc_sync.sync(session, rack.provider, SETTINGS, connect)
    assert booked(session, machine).status == "answering"


def test_a_slow_bmc_is_shown_slow_and_the_others_are_not(
        session: bmdb.Session, redfish: RedfishBmc, tmp_path: Path) -> None:
    rack = redfish_rack(session, tmp_path, redfish, [("u1", "node-1"), ("u2", "node-2")])
    redfish.emulator.set_slow("node-1", 1.2)
    settings = replace(SETTINGS, slow=1.0)
    read_all_now(session, rack, settings)
    slow, prompt = booked(session, rack.id("u1")), booked(session, rack.id("u2"))
    assert slow.status == "slow" and slow.answer_seconds is not None
    assert slow.answer_seconds > 1.0 and "slow above 1s" in (slow.problem or "")
    assert prompt.status == "answering" and (prompt.answer_seconds or 0) < 1.0
    assert session.db.read(bmdb.bmc_sync_counts).by_status["slow"] == 1
    redfish.emulator.set_slow("node-1", 0)
    make_due(session, rack)
    bmc_sync.sync(session, rack.provider, settings, connect)
    assert booked(session, rack.id("u1")).status == "answering"


def test_two_syncs_at_once_keep_one_call_per_bmc_and_the_slots_left_to_recovery(
        db: bmdb.BMDB, session: bmdb.Session, tmp_path: Path) -> None:
    """Four BMCs of three systems each, every request slowed so overlaps would show, two
    sync runs at once on two sessions (two workers): the emulators' logs show one
    request at a time per BMC, and never more in flight than the slots open to the
    sync (the cap less the reserved)."""
    with contextlib.ExitStack() as stack:
        bmcs = [stack.enter_context(running_redfish(
            tmp_path / f"bmc{n}", [(f"s{n}-{k}", "On") for k in range(3)]))
            for n in range(4)]
        rack = rack_of(session, tmp_path / "inventory.toml",
                       [(f"u{n}-{k}", redfish_table(bmc, f"s{n}-{k}"))
                        for n, bmc in enumerate(bmcs) for k in range(3)])
        for n, bmc in enumerate(bmcs):
            for k in range(3):
                bmc.emulator.set_slow(f"s{n}-{k}", 0.15)
        bmc_sync.enroll(session, rack.ids.values(), 0)
        began = time.time()
        results: list[bmc_sync.SyncResult] = []

        def run() -> None:
            """Runs back to back, as a busy beat would start them (each run reads at
            most its pace: ``reads_per_run``)."""
            with db.start_session("sync", interval=10) as own:
                for _ in range(4):
                    results.append(bmc_sync.sync(own, rack.provider, SETTINGS, connect))

        threads = [threading.Thread(target=run) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert sum(r.answered for r in results) == 12, results
        spans = {id(bmc): [r.span for r in bmc.emulator.requests() if r.start >= began]
                 for bmc in bmcs}
        assert all(spans.values())
        assert max(peak_in_flight(s) for s in spans.values()) == 1
        fleet_peak = peak_in_flight([s for each in spans.values() for s in each])
        assert 2 <= fleet_peak <= SETTINGS.calls_cap - SETTINGS.reserved


def test_a_swapped_pair_is_held_by_the_sync_before_anyone_acts(
        session: bmdb.Session, redfish: RedfishBmc, tmp_path: Path) -> None:
    """Each machine's DMI names the other's BMC system: one sync run holds both, and no
    reset went to either BMC system."""
    rack = redfish_rack(session, tmp_path, redfish, [("u1", "node-2"), ("u2", "node-1")])
    for name, own in (("u1", "node-1"), ("u2", "node-2")):
        system = {"uuid": redfish.emulator.system_uuid(own)}
        session.transact(functools.partial(bmdb.set_hardware_report, machine_id=rack.id(name),
                                           report={"hostname": name, "system": system}))
    result = read_all_now(session, rack)
    assert result.held == 2
    for name in ("u1", "u2"):
        holds = session.db.read(functools.partial(bmdb.holds_of, machine_id=rack.id(name),
                                                  kind=bmdb.BMC_MISMATCH_HOLD))
        assert len(holds) == 1 and holds[0].actor == bmc_sync.ACTOR
    assert redfish.emulator.resets("node-1") == redfish.emulator.resets("node-2") == []
    # Held: the next reads leave them alone (nothing their BMC says is theirs).
    make_due(session, rack)
    assert bmc_sync.sync(session, rack.provider, SETTINGS, connect).held == 2


def test_a_bmc_that_says_off_while_the_agent_heartbeats_is_flagged(
        session: bmdb.Session, redfish: RedfishBmc, tmp_path: Path) -> None:
    rack = redfish_rack(session, tmp_path, redfish, [("u1", "node-1"), ("u2", "node-2")])

    def heartbeating(tx: bmdb.Tx) -> None:
        for name in ("u1", "u2"):
            bmdb.set_agent_started(tx, rack.id(name), b"k" * 32)
            bmdb.record_heartbeat(tx, rack.id(name), tx.now)

    session.transact(heartbeating)
    read_all_now(session, rack)
    assert booked(session, rack.id("u1")).contradiction is None  # On and heartbeating
    flagged = booked(session, rack.id("u2")).contradiction  # Off and heartbeating
    assert flagged is not None and "the BMC says Off, but the agent heartbeated" in flagged
    assert session.db.read(bmdb.bmc_sync_counts).contradictions == 1
    assert [h for h in bmc_history(session, rack.id("u2"))] == [flagged]


def test_an_ipmi_bmc_is_read_with_its_chassis_health_and_marked_while_it_is_down(
        session: bmdb.Session, ipmi_bmc: IpmiBmc, tmp_path: Path) -> None:
    """ipmi_sim: one survey per read (one chassis status in its own log), health from
    the chassis status; stopped, it is unreachable until it answers on its port again."""
    rack = rack_of(session, tmp_path / "inventory.toml", [("i1", ipmi_table(ipmi_bmc))])
    machine = rack.id("i1")
    calls_before = len(ipmi_bmc.calls())
    assert read_all_now(session, rack).answered == 1
    found = booked(session, machine)
    assert (found.status, found.health) == ("answering", "OK")
    assert found.health_detail == "chassis status: no fault"
    assert len(ipmi_bmc.calls()) == calls_before + 1
    seen = session.db.read(lambda tx: bmdb.power_of(tx, machine))
    assert seen is not None and seen.state == "On"
    ipmi_bmc.stop()
    try:
        make_due(session, rack)
        bmc_sync.sync(session, rack.provider, SETTINGS, connect_briefly)
        assert booked(session, machine).status == "unreachable"
    finally:
        ipmi_bmc.start()
    make_due(session, rack)
    bmc_sync.sync(session, rack.provider, SETTINGS, connect)
    assert booked(session, machine).status == "answering"


def test_a_new_rack_is_read_over_an_interval_and_never_in_step(session: bmdb.Session) -> None:
    """Jitter: forty new machines' first reads spread over the first interval (not one
    burst), and every next read one interval later plus up to a tenth, never sooner."""
    machines = session.transact(lambda tx: [bmdb.create_machine(tx) for _ in range(40)])
    assert bmc_sync.enroll(session, machines, 100) == 40
    assert bmc_sync.enroll(session, machines, 100) == 0  # booked once
    now = session.db.read(lambda tx: tx.now)
    offsets = sorted((booked(session, m).due_at - now).total_seconds() for m in machines)
    assert offsets[0] >= -1 and offsets[-1] <= 100
    assert offsets[-1] - offsets[0] > 50  # spread, not in step
    nexts = [bmc_sync.next_read_in(100) for _ in range(200)]
    assert all(100 <= n <= 100 * (1 + bmc_sync.JITTER) for n in nexts)
    assert len(set(nexts)) > 100


def test_a_run_reads_at_twice_the_pace_the_interval_needs_and_no_faster(
        session: bmdb.Session, tmp_path: Path) -> None:
    """Forty machines all due (a backlog): at an interval of 100 s and a tick of 10 s
    one run reads 2 x 40 x 10 / 100 = 8 of them, and the rest wait for the next runs,
    so a backlog drains in half an interval instead of in one burst. Never fewer than
    one read per thread."""
    with running_redfish(tmp_path / "redfish", [(f"s{n}", "On") for n in range(40)]) as bmc:
        read_at_pace(session, tmp_path, bmc)


def read_at_pace(session: bmdb.Session, tmp_path: Path, redfish: RedfishBmc) -> None:
    rack = redfish_rack(session, tmp_path, redfish, [(f"u{n}", f"s{n}") for n in range(40)])
    paced = replace(SETTINGS, interval=100, tick=10)
    assert bmc_sync.reads_per_run(40, paced) == 8
    assert bmc_sync.reads_per_run(2, paced) == paced.threads
    bmc_sync.enroll(session, rack.ids.values(), 0)
    first = bmc_sync.sync(session, rack.provider, paced, connect)
    assert first.answered == 8
    reads = [bmc_sync.sync(session, rack.provider, paced, connect).answered for _ in range(4)]
    assert reads == [8, 8, 8, 8]
    assert bmc_sync.sync(session, rack.provider, paced, connect).answered == 0
