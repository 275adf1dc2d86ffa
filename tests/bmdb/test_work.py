"""Work: claim, exclusion, finish/fail/cancel, backoff, handoff and the sweep."""

from __future__ import annotations

import datetime as dt
import functools
import threading
import time
import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

import bmdb
from bmdb import Process
from tests.support.bmdb_helpers import backlog_ids, events, seed_provided, stored_interval


def only(machine_id: uuid.UUID):
    """A retriever for one named machine, whatever its tags."""
    return lambda tx: sa.select(bmdb._schema.machines.c.id).where(
        bmdb._schema.machines.c.id == machine_id
    )


def expire_backoff(db: bmdb.BMDB, machine_id: uuid.UUID, process: Process) -> None:
    """Let the backoff's time pass without waiting for it."""
    b = bmdb._schema.backoff

    def body(tx: bmdb.Tx) -> None:
        tx.execute(
            sa.update(b)
            .where(b.c.machine_id == machine_id, b.c.process == process)
            .values(until=tx.now - dt.timedelta(seconds=1))
        )

    db.read(body)


# -- exclusion ----------------------------------------------------------------


def test_same_process_conflicts_across_sessions(db, session):
    (machine,) = seed_provided(session, 1)
    with db.start_session("other", interval=30) as other:
        assert len(session.claim(Process.AGENT_START, only(machine))) == 1
        assert other.claim(Process.AGENT_START, only(machine)) == []


def test_agent_start_and_recovery_exclude_each_other(db, session):
    (machine,) = seed_provided(session, 1)
    with db.start_session("other", interval=30) as other:
        assert len(session.claim(Process.AGENT_START, only(machine))) == 1
        assert other.claim(Process.RECOVERY, only(machine)) == []


def test_an_installation_and_the_agents_work_exclude_each_other(db, session):
    """An installation rewrites the disk the agent's system runs from: no AgentStart,
    Recovery or power command beside it, and none of them under it."""
    first, second = seed_provided(session, 2)
    with db.start_session("other", interval=30) as other:
        assert len(session.claim(Process.AGENT_START, only(first))) == 1
        assert other.claim(Process.OS_INSTALL, only(first)) == []
        assert len(session.claim(Process.OS_INSTALL, only(second))) == 1
        for process in (Process.AGENT_START, Process.RECOVERY, Process.POWER):
            assert other.claim(process, only(second)) == []


def test_database_itself_refuses_a_second_work_item_in_the_group(db, session):
    (machine,) = seed_provided(session, 1)
    session.claim(Process.AGENT_START, only(machine))

    def sneak_in(tx: bmdb.Tx) -> None:
        tx.execute(
            sa.insert(bmdb._schema.work).values(
                id=uuid.uuid4(), machine_id=machine, process=Process.RECOVERY,
                exclusion_group=bmdb.exclusion_group(Process.RECOVERY),
                session_id=session.id, started_at=tx.now,
            )
        )

    with pytest.raises(IntegrityError):
        session.transact(sneak_in)


def test_database_refuses_a_work_row_with_a_wrong_group(session):
    (machine,) = seed_provided(session, 1)

    def mislabelled(tx: bmdb.Tx) -> None:
        tx.execute(
            sa.insert(bmdb._schema.work).values(
                id=uuid.uuid4(), machine_id=machine, process=Process.RECOVERY,
                exclusion_group="SomethingElse", session_id=session.id, started_at=tx.now,
            )
        )

    with pytest.raises(IntegrityError):
        session.transact(mislabelled)


# -- the life of one claim ------------------------------------------------------


def test_held_machine_leaves_both_backlogs_and_finish_is_atomic(db, session):
    (machine,) = seed_provided(session, 1)
    assert backlog_ids(session, Process.AGENT_START) == {machine}
    (work,) = session.claim_backlog(Process.AGENT_START, limit=5)
    assert backlog_ids(session, Process.AGENT_START) == set()
    # An agent started long ago and never heard of: in the Recovery backlog, yet
    # not claimable while AgentStart work holds the machine.
    session.transact(lambda tx: bmdb.set_agent_started(
        tx, machine, b"o" * 32, started_at=tx.now - dt.timedelta(seconds=120)))
    recovery = bmdb.retriever(Process.RECOVERY, db.thresholds)
    assert set(db.read(lambda tx: tx.execute(recovery(tx)).scalars().all())) == {machine}
    assert backlog_ids(session, Process.RECOVERY) == set()

    work.finish(lambda tx: bmdb.set_agent_started(tx, machine, b"k" * 32))
    assert backlog_ids(session, Process.AGENT_START) == set()
    assert session.claim_backlog(Process.AGENT_START, limit=5) == []
    assert events(db, machine) == [
        (Process.AGENT_START, "Started"), (Process.AGENT_START, "Finished")
    ]


def test_finish_of_lost_work_rolls_back_the_tag_changes(db, session):
    (machine,) = seed_provided(session, 1)
    (work,) = session.claim_backlog(Process.AGENT_START, limit=1)
    work.cancel("operator said so")
    with pytest.raises(bmdb.WorkGone):
        work.finish(lambda tx: bmdb.set_agent_started(tx, machine, b"k" * 32))
    assert "AgentStarted" not in db.read(lambda tx: bmdb.machine_tags(tx, machine))
    assert events(db, machine)[-1] == (Process.AGENT_START, "Canceled")


def test_cancel_leaves_no_backoff(session):
    (machine,) = seed_provided(session, 1)
    (work,) = session.claim_backlog(Process.AGENT_START, limit=1)
    work.cancel()
    assert backlog_ids(session, Process.AGENT_START) == {machine}


# -- backoff --------------------------------------------------------------------


def test_failed_machine_sits_out_its_backoff(db, session):
    (machine,) = seed_provided(session, 1)
    backoff = bmdb.Backoff(initial=1, maximum=5, exponent=2)
    (work,) = session.claim_backlog(Process.AGENT_START, limit=1)
    assert work.fail("ssh: connection refused", backoff) == 1
    assert backlog_ids(session, Process.AGENT_START) == set()
    with pytest.raises(bmdb.MachineInBackoff, match="connection refused"):
        session.claim_machine(Process.AGENT_START, machine)
    time.sleep(1.1)
    assert backlog_ids(session, Process.AGENT_START) == {machine}
    history = db.read(lambda tx: bmdb.machine_history(tx, machine))
    assert history[0]["event"] == "Failed"
    assert history[0]["cause"] == "ssh: connection refused"


def test_stored_intervals_grow_and_reset_after_finish(db, session):
    (machine,) = seed_provided(session, 1)
    backoff = bmdb.Backoff(initial=1, maximum=5, exponent=2)

    def fail_once() -> int | None:
        expire_backoff(db, machine, Process.AGENT_START)
        work = session.claim_machine(Process.AGENT_START, machine)
        work.fail("boom", backoff)
        return stored_interval(db, machine, Process.AGENT_START)

    assert [fail_once() for _ in range(5)] == [1, 2, 4, 5, 5]
    expire_backoff(db, machine, Process.AGENT_START)
    session.claim_machine(Process.AGENT_START, machine).finish()
    assert stored_interval(db, machine, Process.AGENT_START) is None
    assert [fail_once() for _ in range(2)] == [1, 2]


def test_default_backoff_is_the_process_default(session):
    seed_provided(session, 1)
    (work,) = session.claim_backlog(Process.AGENT_START, limit=1)
    assert work.fail("boom") == 300


# -- claiming one named machine -------------------------------------------------


def test_claim_machine_says_why_not(db, session):
    busy, idle = seed_provided(session, 2)
    session.claim_machine(Process.AGENT_START, busy)
    with pytest.raises(bmdb.MachineBusy, match="ShepherdAgentStart work held by session"):
        session.claim_machine(Process.RECOVERY, busy)
    with pytest.raises(bmdb.NotInBacklog):
        session.claim_machine(Process.RECOVERY, idle)
    with pytest.raises(bmdb.NotInBacklog):
        session.claim_machine(Process.AGENT_START, uuid.uuid4())


def test_batch_claim_takes_up_to_the_limit(session):
    seed_provided(session, 7)
    first = session.claim_backlog(Process.AGENT_START, limit=5)
    second = session.claim_backlog(Process.AGENT_START, limit=5)
    assert len(first) == 5
    assert len(second) == 2
    assert not {w.machine_id for w in first} & {w.machine_id for w in second}


def test_machines_not_running_at_the_provider_wait(session):
    seed_provided(session, 2, status="Provisioning")
    assert session.claim_backlog(Process.AGENT_START, limit=5) == []


# -- recovery backlog -----------------------------------------------------------


def test_recovery_backlog_follows_the_thresholds(db, session):
    never_heard, quiet, fresh, young = seed_provided(session, 4)
    long_ago = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)

    def body(tx: bmdb.Tx) -> None:
        for machine in (never_heard, quiet, fresh):
            bmdb.set_agent_started(tx, machine, b"k" * 32, started_at=long_ago)
        bmdb.set_agent_started(tx, young, b"k" * 32)
        bmdb.record_heartbeat(tx, quiet, long_ago)
        bmdb.record_heartbeat(tx, fresh, long_ago)
        hb = bmdb._schema.agent_heartbeat
        tx.execute(
            sa.update(hb).where(hb.c.machine_id == quiet).values(last_heartbeat_at=long_ago)
        )

    session.transact(body)
    assert backlog_ids(session, Process.RECOVERY) == {never_heard, quiet}
    assert backlog_ids(session, Process.AGENT_START) == set()


def test_recovery_finish_returns_the_machine_to_agent_start(db, session):
    (machine,) = seed_provided(session, 1)
    long_ago = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    session.transact(
        lambda tx: bmdb.set_agent_started(tx, machine, b"k" * 32, started_at=long_ago)
    )
    (work,) = session.claim_backlog(Process.RECOVERY, limit=1)

    def drop_agent(tx: bmdb.Tx) -> None:
        bmdb.delete_agent_started(tx, machine)
        bmdb.delete_heartbeat(tx, machine)

    work.finish(drop_agent)
    assert backlog_ids(session, Process.AGENT_START) == {machine}
    assert backlog_ids(session, Process.RECOVERY) == set()


# -- handoff ----------------------------------------------------------------------


def test_adopt_moves_the_claim_to_the_adopter(db, session):
    (machine,) = seed_provided(session, 1)
    (claim,) = session.claim_backlog(Process.AGENT_START, limit=1, dispatch_ttl=30)
    with db.start_session("worker", interval=30) as worker:
        work = worker.adopt(claim.id, machine_id=machine, process=Process.AGENT_START)
        with pytest.raises(bmdb.WorkGone):
            worker.adopt(claim.id)  # already adopted
        with pytest.raises(bmdb.WorkGone):
            claim.finish()  # the claimer no longer holds it
        work.finish()
    assert [e for _, e in events(db, machine)] == ["Started", "Finished"]


def test_adopt_refuses_a_claim_for_another_machine(db, session):
    (machine, other) = seed_provided(session, 2)
    (claim,) = session.claim(Process.AGENT_START, only(machine), dispatch_ttl=30)
    with db.start_session("worker", interval=30) as worker, pytest.raises(bmdb.WorkGone):
        worker.adopt(claim.id, machine_id=other)


def test_named_claim_with_dispatch_ttl_can_be_adopted(db, session):
    """``claim_machine(..., dispatch_ttl=)``: the named claim a handoff needs (an
    operator's ``start``), adoptable like a sourced one, and released by the sweep when
    nobody adopts it in time; the same reasons as without a deadline otherwise."""
    machine, late = seed_provided(session, 2)
    claim = session.claim_machine(Process.AGENT_START, machine, dispatch_ttl=30)
    with pytest.raises(bmdb.MachineBusy, match="ShepherdAgentStart work held by session"):
        session.claim_machine(Process.AGENT_START, machine, dispatch_ttl=30)
    with db.start_session("worker", interval=30) as worker:
        assert db.read(lambda tx: bmdb.work_holder(tx, claim.id)) == session.id
        work = worker.adopt(claim.id, machine_id=machine, process=Process.AGENT_START)
        assert db.read(lambda tx: bmdb.work_holder(tx, claim.id)) == worker.id
        work.finish()
    assert db.read(lambda tx: bmdb.work_holder(tx, claim.id)) is None
    assert [e for _, e in events(db, machine)] == ["Started", "Finished"]

    unadopted = session.claim_machine(Process.AGENT_START, late, dispatch_ttl=1)
    assert db.read(lambda tx: bmdb.active_work(tx, Process.AGENT_START)) == 1
    time.sleep(1.1)
    assert db.sweep().unadopted == 1
    with db.start_session("late-worker", interval=30) as worker, pytest.raises(bmdb.WorkGone):
        worker.adopt(unadopted.id)
    assert db.read(lambda tx: bmdb.active_work(tx, Process.AGENT_START)) == 0


def test_a_named_claim_without_dispatch_ttl_cannot_be_adopted(db, session):
    (machine,) = seed_provided(session, 1)
    claim = session.claim_machine(Process.AGENT_START, machine)
    with db.start_session("worker", interval=30) as worker, pytest.raises(bmdb.WorkGone):
        worker.adopt(claim.id)


def test_unadopted_claim_is_released_after_its_ttl(db, session):
    (machine,) = seed_provided(session, 1)
    (claim,) = session.claim_backlog(Process.AGENT_START, limit=1, dispatch_ttl=1)
    time.sleep(1.1)
    with db.start_session("late-worker", interval=30) as worker, pytest.raises(bmdb.WorkGone):
        worker.adopt(claim.id)
    assert db.sweep().unadopted == 1
    assert events(db, machine)[-1] == (Process.AGENT_START, "Canceled")
    assert backlog_ids(session, Process.AGENT_START) == {machine}


def test_sweep_abandons_work_of_dead_sessions(db, session):
    (machine,) = seed_provided(session, 1)
    dead = db.start_session("doomed", interval=1)
    (work,) = dead.claim_backlog(Process.AGENT_START, limit=1)
    dead._stopped.set()
    dead._thread.join(timeout=5)
    assert db.sweep().abandoned == 0  # still within its deadline
    time.sleep(1.2)
    result = db.sweep()
    assert (result.abandoned, result.sessions_deleted) == (1, 1)
    last = db.read(lambda tx: bmdb.machine_history(tx, machine))[0]
    assert last["event"] == "Abandoned"
    assert str(dead.id) in last["cause"]
    assert backlog_ids(session, Process.AGENT_START) == {machine}
    with pytest.raises(bmdb.SessionExpired):
        work.finish()


# -- several workers --------------------------------------------------------------


def test_parallel_workers_share_the_machines(db, session):
    machines = set(seed_provided(session, 6))
    done: dict[str, list[uuid.UUID]] = {}
    lock = threading.Lock()

    def worker(name: str) -> None:
        with db.start_session(name, interval=30) as own:
            while True:
                claimed = own.claim_backlog(Process.AGENT_START, limit=1)
                if not claimed:
                    return
                (work,) = claimed
                time.sleep(0.2)  # the long part: SSH in, start the agent
                work.finish(lambda tx, m=work.machine_id: bmdb.set_agent_started(
                    tx, m, b"k" * 32))
                with lock:
                    done.setdefault(name, []).append(work.machine_id)

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    finished = [m for ms in done.values() for m in ms]
    assert sorted(finished) == sorted(machines)  # each exactly once
    assert len(done) == 3  # every worker took part
    for machine in machines:
        assert [e for _, e in events(db, machine)] == ["Started", "Finished"]


def test_claimers_skip_rows_another_claimer_holds(pg_url):
    """A claim in progress elsewhere (rows locked) does not block this one: it skips them."""
    db = bmdb.connect(pg_url)
    with db.start_session("a", interval=30) as session:
        machines = seed_provided(session, 4)
        locker = db.engine.connect()
        transaction = locker.begin()
        m = bmdb._schema.machines
        locker.execute(sa.select(m.c.id).where(m.c.id.in_(machines[:2])).with_for_update())
        try:
            started = time.monotonic()
            claimed = session.claim_backlog(Process.AGENT_START, limit=4)
            assert time.monotonic() - started < 2
            assert {w.machine_id for w in claimed} == set(machines[2:])
        finally:
            transaction.rollback()
            locker.close()
    db.close()


# -- races that only PostgreSQL's concurrency can show ------------------------------


def _slow(retriever, seconds: float):
    """The retriever, with a pause after the statement's snapshot is taken."""
    pause = sa.select(sa.literal(1)).select_from(sa.func.pg_sleep(seconds)).scalar_subquery()
    return lambda tx: retriever(tx).where(pause == 1)


def test_a_claim_passes_over_machines_finished_meanwhile_and_fills_its_batch(pg_url):
    """Locked candidates that fail the re-check are replaced, not just dropped.

    The claim's snapshot predates another worker's claim *and* finish of the
    first two machines; it locks one of them, the re-check drops it, and the
    claim must still come back with the machine that is left.
    """
    db = bmdb.connect(pg_url)
    with db.start_session("a", interval=5) as session, \
            db.start_session("b", interval=5) as other:
        *done_elsewhere, left = seed_provided(session, 3)
        result: list[list[bmdb.Work]] = []
        slow = _slow(bmdb.backlog.agent_start, 1.0)
        claimer = threading.Thread(target=lambda: result.append(
            session.claim(Process.AGENT_START, slow, limit=1)))
        claimer.start()
        time.sleep(0.3)  # the claimer's statement has its snapshot and is pausing
        for machine in done_elsewhere:
            (work,) = other.claim(Process.AGENT_START, only(machine))
            work.finish(functools.partial(bmdb.set_agent_started, machine_id=machine,
                                          public_key=b"k" * 32))
        claimer.join(20)
    db.close()
    assert [w.machine_id for w in result[0]] == [left]


def test_claiming_a_named_machine_waits_for_a_claim_in_progress(pg_url):
    """Another claimer's lock makes a named claim wait, not report "not in its backlog"."""
    db = bmdb.connect(pg_url)
    with db.start_session("a", interval=5) as session:
        (machine,) = seed_provided(session, 1)
        locker = db.engine.connect()
        transaction = locker.begin()
        m = bmdb._schema.machines
        locker.execute(sa.select(m.c.id).where(m.c.id == machine).with_for_update())
        threading.Timer(0.5, transaction.rollback).start()  # the other claim gives up
        try:
            work = session.claim_machine(Process.AGENT_START, machine)
        finally:
            locker.close()
        assert work.machine_id == machine
    db.close()


def test_sweep_passes_over_a_dead_session_still_committing_a_claim(pg_url):
    """A session that checked in just before its deadline and commits a claim after it:
    the sweep must neither fail on the new work row nor delete the session under it."""
    db = bmdb.connect(pg_url)
    with db.start_session("observer", interval=5) as observer:
        (machine,) = seed_provided(observer, 1)
        late = db.start_session("late", interval=1)
        late._stopped.set()  # no more heartbeats: the deadline will pass
        late._thread.join(timeout=5)
        checked, proceed = threading.Event(), threading.Event()

        def claim_late(tx: bmdb.Tx) -> None:
            checked.set()
            assert proceed.wait(10)
            bmdb.work._insert_work(tx, late, Process.AGENT_START, [machine], None)

        claimer = threading.Thread(target=lambda: late.transact(claim_late))
        claimer.start()
        assert checked.wait(10)
        time.sleep(1.2)  # the deadline passes while the claim is in flight
        outcome: list = []

        def sweep() -> None:
            try:
                outcome.append(db.sweep())
            except Exception as error:  # the assertion below shows it
                outcome.append(error)

        sweeper = threading.Thread(target=sweep)
        sweeper.start()
        time.sleep(0.5)
        proceed.set()
        claimer.join(10)
        sweeper.join(10)
        assert isinstance(outcome[0], bmdb.SweepResult), outcome
        assert outcome[0].sessions_deleted == 0
        again = db.sweep()
        assert (again.abandoned, again.sessions_deleted) == (1, 1)
        assert events(db, machine) == [(Process.AGENT_START, "Started"),
                                       (Process.AGENT_START, "Abandoned")]
    db.close()
