"""Fleet-wide singletons and capacity cooldowns."""

import threading
import time

import bmdb
from bmdb import hold_singleton as hold


def test_only_one_holder_at_a_time(db, session):
    with db.start_session("other", interval=30) as other:
        with hold(session, "reconcile") as first, hold(other, "reconcile") as second:
            assert (first, second) == (True, False)
        with hold(other, "reconcile") as after_release:
            assert after_release


def test_a_waiting_claimant_gets_the_hold_when_it_is_released(db, session):
    """An operator's reconcile waits for beat's to end instead of being skipped."""
    with db.start_session("other", interval=30) as other:
        released = threading.Event()

        def hold_briefly() -> None:
            with hold(other, "reconcile") as held:
                assert held
                started.set()
                time.sleep(0.5)
            released.set()

        started = threading.Event()
        holder = threading.Thread(target=hold_briefly)
        holder.start()
        assert started.wait(10)
        with hold(session, "reconcile") as at_once:
            assert not at_once
        with hold(session, "reconcile", wait=10, poll=0.05) as waited:
            assert waited and released.is_set()
        holder.join(timeout=10)
        with hold(other, "reconcile") as held, hold(session, "reconcile", wait=0.3) as late:
            assert (held, late) == (True, False)


def test_a_dead_holder_is_taken_over_at_once(db, session):
    dead = db.start_session("dead", interval=1)
    assert dead.transact(lambda tx: bmdb.try_acquire_singleton(tx, "reconcile"))
    dead._stopped.set()
    dead._thread.join(timeout=5)
    time.sleep(1.2)
    with hold(session, "reconcile") as held:
        assert held


def test_concurrent_claimants_get_one_hold(db):
    sessions = [db.start_session(f"s{i}", interval=5) for i in range(4)]
    results: list[bool] = []
    barrier = threading.Barrier(len(sessions))

    def claim(own: bmdb.Session) -> None:
        barrier.wait()
        results.append(own.transact(lambda tx: bmdb.try_acquire_singleton(tx, "reconcile")))

    threads = [threading.Thread(target=claim, args=(s,)) for s in sessions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    for own in sessions:
        own.close()
    assert sorted(results) == [False, False, False, True]


def test_sweep_deletes_holds_of_dead_sessions(db):
    dead = db.start_session("dead", interval=1)
    dead.transact(lambda tx: bmdb.try_acquire_singleton(tx, "reconcile"))
    dead.close()
    db.sweep()
    rows = db.read(lambda tx: tx.execute(bmdb._schema.singletons.select()).all())
    assert rows == []


def test_capacity_cooldown(session):
    session.transact(lambda tx: bmdb.cool_down(tx, "sim", "r1", 1, "provisioning failed"))
    assert session.transact(lambda tx: bmdb.cooling(tx, "sim")) == {
        "r1": "provisioning failed"
    }
    assert session.transact(lambda tx: bmdb.cooling(tx, "other")) == {}
    time.sleep(1.1)
    assert session.transact(lambda tx: bmdb.cooling(tx, "sim")) == {}
