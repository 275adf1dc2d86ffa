"""ExclusivePower: one call per BMC at a time across processes and threads (real PostgreSQL).

The "BMC" here is a file-backed stand-in shared by every process of a test: a call
creates a marker file exclusively for its duration, so two calls at once are seen
(and the detector is shown to see them when nothing excludes them).
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import bmdb
from shepherd.power import (
    BmcBusy,
    BmcUnreachable,
    BootDevice,
    BootOverride,
    ExclusivePower,
    PowerAction,
    PowerState,
    SystemIdentity,
    singleton_name,
)

LOCK = "bmc:redfish:https://192.0.2.117:623"


class SharedBmc:
    """Stands for one BMC that several processes talk to: notes every call's span,
    and every call that started while another was running."""

    description = "redfish https://192.0.2.117 (stand-in)"
    reads_state = True

    def __init__(self, directory: Path, hold: float = 0.1,
                 barrier: threading.Barrier | None = None) -> None:
        self.directory = directory
        self.hold = hold
        self.barrier = barrier
        self.fail_next = False

    def power_state(self) -> PowerState:
        self._call("power_state")
        return PowerState.ON

    def act(self, action: PowerAction) -> None:
        self._call(str(action))

    def supports(self, action: PowerAction) -> bool:
        self._call("supports")
        return action != PowerAction.GRACEFUL_RESTART

    def boot_device(self) -> BootOverride:
        self._call("boot_device")
        return BootOverride(BootDevice.DISK, True, "stand-in")

    def set_boot_device(self, device: BootDevice, *, persistent: bool = False) -> None:
        self._call(f"set_boot_device {device}")

    def identity(self) -> SystemIdentity:
        self._call("identity")
        return SystemIdentity(uuid="stand-in")

    def _call(self, what: str) -> None:
        if self.fail_next:
            self.fail_next = False
            raise BmcUnreachable(f"{self.description}: {what}: no answer")
        start = time.monotonic()
        try:
            marker = os.open(self.directory / "busy", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            marker = None
            self._note(f"overlap {os.getpid()} {what}")
        try:
            if self.barrier is not None:
                self.barrier.wait()
            time.sleep(self.hold)
        finally:
            if marker is not None:
                os.close(marker)
                os.unlink(self.directory / "busy")
        self._note(f"call {os.getpid()} {what} {start:.6f} {time.monotonic():.6f}")

    def _note(self, line: str) -> None:
        with open(self.directory / "calls.log", "a") as handle:
            handle.write(line + "\n")

    def lines(self) -> list[str]:
        path = self.directory / "calls.log"
        return path.read_text().splitlines() if path.exists() else []

    def overlaps(self) -> list[str]:
        return [line for line in self.lines() if line.startswith("overlap")]

    def calls(self) -> list[str]:
        return [line for line in self.lines() if line.startswith("call")]


@pytest.fixture
def db(pg_url: str) -> Iterator[bmdb.BMDB]:
    handle = bmdb.connect(pg_url)
    yield handle
    handle.close()


def sessions(db: bmdb.BMDB, count: int) -> list[bmdb.Session]:
    return [db.start_session(f"power-test-{i}", interval=30) for i in range(count)]


def _worker(pg_url: str, directory: str, calls: int) -> None:
    """One process of its own (a Celery worker, another host): its own BMDB pool and session."""
    db = bmdb.connect(pg_url)
    try:
        with db.start_session(f"worker-{os.getpid()}", interval=30) as session:
            power = ExclusivePower(SharedBmc(Path(directory), hold=0.1), session, LOCK, wait=60)
            for _ in range(calls):
                power.act(PowerAction.FORCE_RESTART)
                assert power.power_state() == PowerState.ON
    finally:
        db.close()


def test_calls_from_several_processes_never_overlap(pg_url: str, tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")  # no inherited pools or threads
    workers = [context.Process(target=_worker, args=(pg_url, str(tmp_path), 3))
               for _ in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=90)
    assert [w.exitcode for w in workers] == [0, 0, 0]
    bmc = SharedBmc(tmp_path)
    assert bmc.overlaps() == []
    spans = sorted((float(start), float(end))
                   for *_, start, end in (line.split() for line in bmc.calls()))
    assert len(spans) == 3 * 3 * 2
    assert len({line.split()[1] for line in bmc.calls()}) == 3, "every process called"
    assert all(end <= next_start for (_, end), (next_start, _) in itertools.pairwise(spans))


def test_the_overlap_detector_sees_calls_at_once(tmp_path: Path) -> None:
    """Without ExclusivePower, two calls held together by a barrier overlap."""
    bmc = SharedBmc(tmp_path, hold=0.05, barrier=threading.Barrier(2, timeout=10))
    threads = [threading.Thread(target=bmc.power_state) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert len(bmc.overlaps()) == 1 and len(bmc.calls()) == 2


def test_threads_sharing_one_session_never_overlap(db: bmdb.BMDB, tmp_path: Path) -> None:
    """To the BMDB, threads of one session are one holder: the process lock separates them."""
    bmc = SharedBmc(tmp_path, hold=0.05)
    with db.start_session("shared", interval=30) as session:
        power = ExclusivePower(bmc, session, LOCK, wait=30)

        def power_on_three_times() -> None:
            for _ in range(3):
                power.act(PowerAction.POWER_ON)

        threads = [threading.Thread(target=power_on_three_times) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    assert len(bmc.calls()) == 12 and bmc.overlaps() == []


def test_different_bmcs_do_not_wait_for_each_other(db: bmdb.BMDB, tmp_path: Path) -> None:
    barrier = threading.Barrier(2, timeout=10)  # passes only if both calls run at once
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    a, b = sessions(db, 2)
    try:
        powers = [ExclusivePower(SharedBmc(first, 0.01, barrier), a, "bmc:ipmi:10.0.0.1:623"),
                  ExclusivePower(SharedBmc(second, 0.01, barrier), b, "bmc:ipmi:10.0.0.2:623")]
        threads = [threading.Thread(target=p.power_state) for p in powers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=15)
        assert not barrier.broken
        assert len(SharedBmc(first).calls()) == 1 and len(SharedBmc(second).calls()) == 1
    finally:
        a.close()
        b.close()


def test_a_bmc_held_elsewhere_is_busy_after_the_wait(db: bmdb.BMDB, tmp_path: Path) -> None:
    other, ours = sessions(db, 2)
    try:
        name = singleton_name(LOCK)
        assert other.transact(lambda tx: bmdb.try_acquire_singleton(tx, name))
        bmc = SharedBmc(tmp_path)
        power = ExclusivePower(bmc, ours, LOCK, wait=0.6)
        started = time.monotonic()
        with pytest.raises(BmcBusy) as busy:
            power.act(PowerAction.POWER_OFF)
        elapsed = time.monotonic() - started
        assert 0.6 <= elapsed < 2.0, f"{elapsed:.2f}s"
        assert bmc.description in str(busy.value)
        assert bmc.calls() == []
        other.transact(lambda tx: bmdb.release_singleton(tx, name))
        power.act(PowerAction.POWER_OFF)
        assert len(bmc.calls()) == 1
    finally:
        other.close()
        ours.close()


def test_a_call_in_this_process_makes_others_here_busy(db: bmdb.BMDB, tmp_path: Path) -> None:
    """A thread of another session waits on the process lock first, bounded the same way."""
    release = threading.Event()
    entered = threading.Event()

    class SlowBmc(SharedBmc):
        def _call(self, what: str) -> None:
            entered.set()
            release.wait(10)
            super()._call(what)

    holder_session, waiter_session = sessions(db, 2)
    try:
        holder = ExclusivePower(SlowBmc(tmp_path, hold=0), holder_session, LOCK)
        thread = threading.Thread(target=holder.power_state)
        thread.start()
        assert entered.wait(10)
        waiter = ExclusivePower(SharedBmc(tmp_path), waiter_session, LOCK, wait=0.4)
        started = time.monotonic()
        with pytest.raises(BmcBusy):
            waiter.power_state()
        assert 0.4 <= time.monotonic() - started < 1.5
        release.set()
        thread.join(timeout=10)
        assert waiter.power_state() == PowerState.ON
    finally:
        release.set()
        holder_session.close()
        waiter_session.close()


def test_a_dead_holder_is_taken_over(db: bmdb.BMDB, tmp_path: Path) -> None:
    """A worker that died mid-call leaves the name to its session, which ends with it."""
    dead, ours = sessions(db, 2)
    try:
        assert dead.transact(lambda tx: bmdb.try_acquire_singleton(tx, singleton_name(LOCK)))
        dead.close()  # no release: as a killed worker's session lapses
        started = time.monotonic()
        ExclusivePower(SharedBmc(tmp_path), ours, LOCK, wait=5).act(PowerAction.POWER_ON)
        assert time.monotonic() - started < 1.0
    finally:
        ours.close()


def test_a_failing_call_releases_the_bmc(db: bmdb.BMDB, tmp_path: Path) -> None:
    first, second = sessions(db, 2)
    try:
        bmc = SharedBmc(tmp_path)
        bmc.fail_next = True
        with pytest.raises(BmcUnreachable):
            ExclusivePower(bmc, first, LOCK).act(PowerAction.FORCE_RESTART)
        name = singleton_name(LOCK)
        assert second.transact(lambda tx: bmdb.try_acquire_singleton(tx, name))
        second.transact(lambda tx: bmdb.release_singleton(tx, name))
    finally:
        first.close()
        second.close()


def test_it_passes_the_inner_control_through(db: bmdb.BMDB, tmp_path: Path) -> None:
    with db.start_session("pass", interval=30) as session:
        bmc = SharedBmc(tmp_path, hold=0)
        power = ExclusivePower(bmc, session, LOCK)
        assert power.description == bmc.description and power.reads_state
        assert power.supports(PowerAction.FORCE_RESTART)
        assert not power.supports(PowerAction.GRACEFUL_RESTART)
        assert power.power_state() == PowerState.ON
        assert len(bmc.calls()) == 3  # supports() asks the BMC too, so it is held


def test_singleton_names_fit_the_column() -> None:
    long_lock = "bmc:redfish:https://" + "x" * 300 + ":623"
    names = {singleton_name(lock) for lock in (LOCK, long_lock, "bmc:ipmi:10.0.0.1:623")}
    assert len(names) == 3
    assert all(name.startswith("bmc:") and len(name) <= 64 for name in names)
    assert singleton_name(LOCK) == singleton_name(LOCK)


# -- the fleet-wide cap of BMC calls in flight ------------------------------------------


def spans(directories: list[Path]) -> list[tuple[float, float]]:
    """Every call's (start, end) on the stand-in BMCs in ``directories``."""
    found = []
    for directory in directories:
        for line in SharedBmc(directory).calls():
            *_, start, end = line.split()
            found.append((float(start), float(end)))
    return found


def most_at_once(found: list[tuple[float, float]]) -> int:
    """The most calls in flight at one moment (monotonic clocks: one per host)."""
    events = sorted([(start, 1) for start, _ in found] + [(end, -1) for _, end in found])
    running = peak = 0
    for _, change in events:
        running += change
        peak = max(peak, running)
    return peak


def _capped_worker(pg_url: str, directory: str, lock: str, calls: int, cap: int) -> None:
    db = bmdb.connect(pg_url)
    try:
        with db.start_session(f"worker-{os.getpid()}", interval=30) as session:
            power = ExclusivePower(SharedBmc(Path(directory), hold=0.2), session, lock,
                                   wait=60, calls_cap=cap)
            for _ in range(calls):
                power.act(PowerAction.POWER_ON)
    finally:
        db.close()


def bmc_directories(tmp_path: Path, count: int) -> list[Path]:
    directories = [tmp_path / f"bmc-{number}" for number in range(count)]
    for directory in directories:
        directory.mkdir()
    return directories


def test_the_fleet_wide_cap_holds_across_processes(pg_url: str, tmp_path: Path) -> None:
    """Four workers, each calling its own BMC: never more than the cap (2) in flight,
    and the cap is reached (it limits, it does not serialise)."""
    directories = bmc_directories(tmp_path, 4)
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_capped_worker, args=(
        pg_url, str(directory), f"bmc:ipmi:10.0.0.{number}:623", 3, 2))
        for number, directory in enumerate(directories)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=90)
    assert [worker.exitcode for worker in workers] == [0] * 4
    found = spans(directories)
    assert len(found) == 12
    assert most_at_once(found) == 2


def test_threads_of_one_session_share_the_cap(db: bmdb.BMDB, tmp_path: Path) -> None:
    """To the BMDB a slot held by one thread is its session's, free to its siblings:
    the process keeps its threads apart, so the cap holds within a session too."""
    directories = bmc_directories(tmp_path, 4)
    with db.start_session("threaded", interval=30) as session:
        powers = [ExclusivePower(SharedBmc(directory, hold=0.2), session,
                                 f"bmc:ipmi:10.0.1.{number}:623", wait=60, calls_cap=2)
                  for number, directory in enumerate(directories)]

        def twice(power: ExclusivePower) -> None:
            for _ in range(2):
                power.act(PowerAction.POWER_OFF)

        threads = [threading.Thread(target=twice, args=(power,)) for power in powers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    found = spans(directories)
    assert len(found) == 8 and most_at_once(found) == 2


def test_a_full_cap_is_busy_after_the_wait_and_keeps_no_bmc(db: bmdb.BMDB,
                                                            tmp_path: Path) -> None:
    other, ours = sessions(db, 2)
    try:
        slots = ["bmc-call:0", "bmc-call:1"]

        def take_both(tx: bmdb.Tx) -> bool:
            return all([bmdb.try_acquire_singleton(tx, name) for name in slots])

        assert other.transact(take_both)
        bmc = SharedBmc(tmp_path)
        power = ExclusivePower(bmc, ours, LOCK, wait=0.6, calls_cap=2)
        with pytest.raises(BmcBusy, match="2 BMC calls are in flight fleet-wide"):
            power.act(PowerAction.POWER_OFF)
        assert bmc.calls() == []
        # The BMC's own name was given back with the refused slot: another can take it.
        assert other.transact(lambda tx: bmdb.try_acquire_singleton(tx, singleton_name(LOCK)))
        other.transact(lambda tx: bmdb.release_singleton(tx, singleton_name(LOCK)))
        other.transact(lambda tx: bmdb.release_singleton(tx, slots[0]))
        power.act(PowerAction.POWER_OFF)
        assert len(bmc.calls()) == 1
    finally:
        other.close()
        ours.close()


def test_the_slots_reserved_stay_free_for_recovery_however_busy_the_sync(
        db: bmdb.BMDB, tmp_path: Path) -> None:
    """The sync (``reserved=1`` of 3) may hold only the last two slots: with both taken,
    a third sync call is busy, and Recovery's call (``reserved=0``) still gets the
    first slot at once."""
    sync_a, sync_b, recovery = sessions(db, 3)
    try:
        directories = bmc_directories(tmp_path, 4)
        holders = [ExclusivePower(SharedBmc(directories[n]), session,
                                  f"bmc:ipmi:10.0.2.{n}:623", wait=0.6, calls_cap=3,
                                  reserved=1) for n, session in enumerate((sync_a, sync_b))]
        with holders[0].held(), holders[1].held():
            assert {h._slot for h in holders} == {"bmc-call:1", "bmc-call:2"}
            third = ExclusivePower(SharedBmc(directories[2]), recovery, "bmc:ipmi:10.0.2.2:623",
                                   wait=0.6, calls_cap=3, reserved=1)
            with pytest.raises(BmcBusy, match="2 BMC calls are in flight fleet-wide"):
                third.act(PowerAction.POWER_OFF)
            first = ExclusivePower(SharedBmc(directories[3]), recovery,
                                   "bmc:ipmi:10.0.2.3:623", wait=0.6, calls_cap=3)
            first.act(PowerAction.POWER_OFF)
            assert first._slot == "bmc-call:0"
        with pytest.raises(ValueError, match="at least one of 3"):
            ExclusivePower(SharedBmc(directories[0]), sync_a, LOCK, calls_cap=3, reserved=3)
    finally:
        for session in (sync_a, sync_b, recovery):
            session.close()
