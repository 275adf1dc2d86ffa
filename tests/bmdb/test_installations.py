"""Installations in the BMDB: the backlog, generations, the heartbeat answer, progress,
settling, served images and the inventory's wishes (``bmdb.installations``).

Every test but the concurrent one runs on PostgreSQL and SQLite (the ``db`` fixture);
the race between two dispatchers needs PostgreSQL's row locks and real concurrency.
"""

from __future__ import annotations

import datetime as dt
import threading
import uuid
from typing import Any

import pytest
import sqlalchemy as sa

import bmdb
from bmdb import Process
from tests.support.bmdb_helpers import backlog_ids, seed_provided

OS_INSTALL = Process.OS_INSTALL
REQUEST: dict[str, Any] = {"kind": "image", "disk": "serial=S1",
                           "image": {"name": "debian-12", "served": True}}


def in_flight(tx: bmdb.Tx) -> list[tuple[uuid.UUID, bmdb.InFlight]]:
    """Every installation in flight (what ``shepherd up`` shows, unbounded here)."""
    return bmdb.installations_in_progress(tx, 1000)


# -- helpers ------------------------------------------------------------------------


def heard(session: bmdb.Session, count: int = 1, *, ago: float = 0.0) -> list[uuid.UUID]:
    """``count`` Running machines whose agent started and last heartbeated ``ago`` s ago."""
    machines = seed_provided(session, count)

    def body(tx: bmdb.Tx) -> None:
        hb = bmdb._schema.agent_heartbeat
        for machine in machines:
            bmdb.set_agent_started(tx, machine, b"\x01" * 32)
            bmdb.record_heartbeat(tx, machine, tx.now)
            tx.execute(sa.update(hb).where(hb.c.machine_id == machine)
                       .values(last_heartbeat_at=tx.now - dt.timedelta(seconds=ago)))

    session.transact(body)
    return machines


def want(session: bmdb.Session, machine: uuid.UUID, image: str = "debian-12",
         disk: str = "serial=S1", *, by: str = "alice", reason: str = "fresh system") -> None:
    session.transact(lambda tx: bmdb.want_installation(
        tx, machine, image=image, disk=disk, origin="operator", by=by, reason=reason))


def withdraw(session: bmdb.Session, machine: uuid.UUID, *, by: str = "bob",
             reason: str = "wrong image") -> bool:
    return session.transact(lambda tx: bmdb.withdraw_installation(tx, machine, by=by,
                                                                  reason=reason))


def dispatch(session: bmdb.Session, machine: uuid.UUID,
             request: dict[str, Any] | None = None) -> int:
    """Put an installation in flight; by default of what the machine wants, as the
    workflow's request names it (its image and disk)."""
    def body(tx: bmdb.Tx) -> int:
        wish = bmdb.installation_of(tx, machine).wanted
        chosen = request or (REQUEST if wish is None else {
            **REQUEST, "disk": wish.disk, "image": {"name": wish.image, "served": True}})
        return bmdb.dispatch_installation(tx, machine, chosen)

    return session.transact(body)


def settle(session: bmdb.Session, machine: uuid.UUID, generation: int, *,
           installed: bool) -> None:
    session.transact(lambda tx: bmdb.settle_installation(
        tx, machine, generation, "installed" if installed else None))


def state(session: bmdb.Session, machine: uuid.UUID) -> bmdb.Installation:
    return session.transact(lambda tx: bmdb.installation_of(tx, machine))


def wanted(session: bmdb.Session, machine: uuid.UUID) -> bmdb.Wanted:
    found = state(session, machine).wanted
    assert found is not None, f"nothing wanted for {machine}"
    return found


def flight(session: bmdb.Session, machine: uuid.UUID) -> bmdb.InFlight:
    found = state(session, machine).in_flight
    assert found is not None, f"nothing in flight on {machine}"
    return found


def pending_answer(session: bmdb.Session, machine: uuid.UUID) -> dict[str, Any] | None:
    """What the machine's next heartbeat answer would carry (no report in it)."""
    def body(tx: bmdb.Tx) -> dict[str, Any] | None:
        credentials = bmdb.lock_agent_credentials(tx, [machine]).get(machine)
        assert credentials is not None
        return credentials.pending_installation()

    return session.transact(body)


def installation_history(db: bmdb.BMDB, machine: uuid.UUID) -> list[tuple[str, str]]:
    """(event, cause) of the machine's OS_INSTALL history, oldest first."""
    rows = db.read(lambda tx: bmdb.machine_history(tx, machine))
    return [(row["event"], row["cause"]) for row in reversed(rows)
            if row["process"] == OS_INSTALL]


# -- the backlog ----------------------------------------------------------------------


def test_wanted_machine_enters_the_backlog_only_while_its_agent_is_heard(db, session):
    """The fixture's heartbeat threshold is 30 s: an agent silent longer would never
    pick the request up, so the installation waits rather than being dispatched."""
    (fresh,) = heard(session)
    (stale,) = heard(session, ago=45)
    (unwanted,) = heard(session)
    (never_heard,) = seed_provided(session, 1)
    for machine in (fresh, stale, never_heard):
        want(session, machine)
    assert backlog_ids(session, OS_INSTALL) == {fresh}
    assert unwanted not in backlog_ids(session, OS_INSTALL)
    # The stale agent heartbeats again: in the backlog from then on.
    session.transact(lambda tx: bmdb.record_heartbeat(tx, stale, tx.now))
    assert backlog_ids(session, OS_INSTALL) == {fresh, stale}


def test_held_or_missing_machine_is_out_of_the_backlog(db, session):
    maintained, quarantined, missing, plain = heard(session, 4)
    for machine in (maintained, quarantined, missing, plain):
        want(session, machine)

    def hold(tx: bmdb.Tx) -> None:
        bmdb.put_hold(tx, maintained, bmdb.MAINTENANCE, "new cables", "carol")
        bmdb.put_hold(tx, quarantined, bmdb.QUARANTINE, "ladder exhausted", "recovery")
        bmdb.set_provider_status(tx, [missing], bmdb.ProviderStatus.MISSING)

    session.transact(hold)
    assert backlog_ids(session, OS_INSTALL) == {plain}
    session.transact(lambda tx: bmdb.lift_hold(tx, maintained, bmdb.MAINTENANCE, "carol"))
    assert backlog_ids(session, OS_INSTALL) == {plain, maintained}


def test_settled_installation_leaves_the_backlog(db, session):
    installed, withdrawn = heard(session, 2)
    want(session, installed)
    want(session, withdrawn)
    assert backlog_ids(session, OS_INSTALL) == {installed, withdrawn}
    settle(session, installed, dispatch(session, installed), installed=True)
    assert withdraw(session, withdrawn)
    assert backlog_ids(session, OS_INSTALL) == set()
    assert (wanted(session, installed).outcome,
            wanted(session, withdrawn).outcome) == ("installed", "canceled")
    # Wanted again: pending again.
    want(session, withdrawn, "debian-13")
    assert backlog_ids(session, OS_INSTALL) == {withdrawn}


# -- generations -----------------------------------------------------------------------


def test_dispatch_numbers_each_machines_installations_and_never_reuses_one(db, session):
    first, second = heard(session, 2)
    want(session, first)
    want(session, second)
    assert [dispatch(session, first) for _ in range(3)] == [1, 2, 3]
    assert dispatch(session, second) == 1
    assert withdraw(session, first)
    settle(session, first, 3, installed=False)
    want(session, first, "debian-13")
    assert wanted(session, first).generation == 3  # a new wish keeps the count
    assert dispatch(session, first) == 4
    assert (wanted(session, first).generation, flight(session, first).generation) == (4, 4)


@pytest.mark.timeout(30)
def test_concurrent_dispatches_never_share_a_generation(pg_url):
    """Two sessions dispatch for one machine at once. The deterministic round: one
    dispatches and holds its transaction open while the other dispatches; a read of the
    committed count before writing it back would give both the same number. Then a
    free-for-all of both threads."""
    db = bmdb.connect(pg_url, thresholds=bmdb.Thresholds(first_heartbeat=60, heartbeat=30))
    try:
        with db.start_session("one", interval=10) as one, \
                db.start_session("two", interval=10) as two:
            (machine,) = heard(one)
            want(one, machine)
            dispatched = threading.Event()
            got: dict[str, int] = {}

            def slow(tx: bmdb.Tx) -> int:
                generation = bmdb.dispatch_installation(tx, machine, REQUEST)
                dispatched.set()
                tx.execute(sa.text("SELECT pg_sleep(0.3)"))
                return generation

            def second() -> None:
                assert dispatched.wait(5)
                got["second"] = dispatch(two, machine)

            racer = threading.Thread(target=second)
            racer.start()
            got["first"] = one.transact(slow)
            racer.join(10)
            assert not racer.is_alive()
            assert got == {"first": 1, "second": 2}

            rounds = 25
            seen: dict[str, list[int]] = {"one": [], "two": []}
            start = threading.Barrier(2)

            def burst(name: str, session: bmdb.Session) -> None:
                start.wait(5)
                seen[name].extend(dispatch(session, machine) for _ in range(rounds))

            threads = [threading.Thread(target=burst, args=(name, s))
                       for name, s in (("one", one), ("two", two))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(20)
            assert not any(thread.is_alive() for thread in threads)
            every = seen["one"] + seen["two"]
            assert sorted(every) == list(range(3, 3 + 2 * rounds))
            assert seen["one"] == sorted(seen["one"]) and seen["two"] == sorted(seen["two"])
            assert flight(one, machine).generation == 2 + 2 * rounds
    finally:
        db.close()


# -- the heartbeat answer, progress, settling ----------------------------------------------


def test_heartbeat_answer_carries_the_request_until_its_generation_is_reported(db, session):
    (machine,) = heard(session)
    want(session, machine)
    assert pending_answer(session, machine) is None
    first = {**REQUEST, "disk": "serial=FIRST"}
    assert dispatch(session, machine, first) == 1
    assert pending_answer(session, machine) == {"generation": 1, "request": first}

    def reporting(tx: bmdb.Tx) -> tuple[Any, Any]:
        """What a heartbeat that carries the report of generation 1 is answered."""
        credentials = bmdb.lock_agent_credentials(tx, [machine]).get(machine)
        assert credentials is not None
        return credentials.pending_installation(1), credentials.pending_installation(0)

    assert session.transact(reporting) == (None, {"generation": 1, "request": first})
    session.transact(lambda tx: bmdb.set_os_installation_report(
        tx, machine, 1, {"status": "failed", "cause_kind": "digest"}))
    assert pending_answer(session, machine) is None

    # A new generation is answered again, whatever the old report said; settled, never.
    second = {**REQUEST, "disk": "serial=SECOND"}
    assert dispatch(session, machine, second) == 2
    assert pending_answer(session, machine) == {"generation": 2, "request": second}
    settle(session, machine, 2, installed=False)
    assert pending_answer(session, machine) is None


def test_progress_for_a_stale_generation_changes_nothing(db, session):
    (machine,) = heard(session)
    want(session, machine)
    dispatch(session, machine)
    dispatch(session, machine)
    before = flight(session, machine)
    assert before.generation == 2 and before.progress is None
    stale = {"phase": "writing", "bytes_done": 1, "bytes_total": 2}
    session.transact(lambda tx: bmdb.record_installation_progress(tx, machine, 1, stale))
    assert state(session, machine).in_flight == before

    current = {"phase": "verifying", "bytes_done": 5, "bytes_total": 9}
    session.transact(lambda tx: bmdb.record_installation_progress(tx, machine, 2, current))
    after = flight(session, machine)
    assert after.progress == current
    assert after.progress_at is not None and before.progress_at is not None
    assert after.progress_at >= before.progress_at
    # Settled: progress no longer lands anywhere (no row comes back).
    settle(session, machine, 2, installed=False)
    session.transact(lambda tx: bmdb.record_installation_progress(tx, machine, 2, current))
    assert state(session, machine).in_flight is None


def test_settle_installed_settles_the_wish_only_for_its_own_generation(db, session):
    (machine,) = heard(session)
    want(session, machine)
    dispatch(session, machine)
    dispatch(session, machine)  # generation 2 in flight; the wish counts 2
    settle(session, machine, 1, installed=True)
    assert wanted(session, machine).pending and flight(session, machine).generation == 2
    settle(session, machine, 2, installed=True)
    assert state(session, machine).in_flight is None
    settled = wanted(session, machine)
    assert settled.outcome == "installed" and settled.settled_at is not None


def test_a_wish_changed_in_flight_is_not_settled_by_the_older_installation(db, session):
    """An operator asks for debian-12; while generation 1 writes it, they ask for
    debian-13 instead. Generation 1 then verifies debian-12: debian-13 was never written,
    so its wish must stay pending (and the machine in the backlog)."""
    (machine,) = heard(session)
    want(session, machine, "debian-12")
    generation = dispatch(session, machine)
    want(session, machine, "debian-13", reason="debian-12 is too old")
    settle(session, machine, generation, installed=True)
    current = wanted(session, machine)
    assert current.image == "debian-13"
    assert current.pending, f"debian-13 settled as {current.outcome!r}"


def test_served_image_in_flight_names_only_a_served_image_in_flight(db, session):
    served, elsewhere, idle = heard(session, 3)
    for machine in (served, elsewhere, idle):
        want(session, machine)
    assert dispatch(session, served) == 1
    dispatch(session, elsewhere, {**REQUEST, "image": {"name": "ubuntu", "served": False}})
    read = db.read(lambda tx: [bmdb.served_image_in_flight(tx, m)
                               for m in (served, elsewhere, idle)])
    assert read == [(1, "debian-12"), None, None]
    assert len(db.read(in_flight)) == 2
    settle(session, served, 1, installed=False)
    assert db.read(lambda tx: bmdb.served_image_in_flight(tx, served)) is None
    assert len(db.read(in_flight)) == 1


# -- the inventory's wishes -----------------------------------------------------------------


def test_inventory_wishes_are_applied_once_and_leave_an_operators_alone(db, session):
    fresh, operated, unlisted = seed_provided(session, 3)
    want(session, operated, "custom-image", "serial=OP", by="dave", reason="testing")

    def sync(entries: list[tuple[str, str, str]]) -> int:
        return session.transact(lambda tx: bmdb.sync_inventory_installations(tx, "test",
                                                                             entries))

    entries = [(str(fresh), "debian-12", "serial=A"), (str(operated), "debian-12", "serial=B"),
               ("not-registered", "debian-12", "serial=C")]
    assert sync(entries) == 1
    wish = wanted(session, fresh)
    assert (wish.image, wish.disk, wish.origin, wish.requested_by, wish.pending) == (
        "debian-12", "serial=A", "inventory", "inventory", True)
    assert state(session, unlisted).wanted is None
    operator = wanted(session, operated)
    assert (operator.image, operator.disk, operator.origin) == (
        "custom-image", "serial=OP", "operator")

    # The same entries again (every update run): nothing new, no history row.
    rows = len(installation_history(db, fresh))
    assert sync(entries) == 0
    assert len(installation_history(db, fresh)) == rows
    # Installed, then the same entry again: stays settled (no reinstall every run).
    settle(session, fresh, dispatch(session, fresh), installed=True)
    assert sync(entries) == 0
    assert wanted(session, fresh).outcome == "installed"
    # A changed entry is a new wish, counted on from the old generation.
    changed = [(str(fresh), "debian-13", "serial=A")]
    assert sync(changed) == 1
    wish = wanted(session, fresh)
    assert (wish.image, wish.pending, wish.generation) == ("debian-13", True, 1)
    assert sync([]) == 0


def test_wanted_and_withdrawn_are_in_history_with_who_and_why(db, session):
    (machine,) = seed_provided(session, 1)
    want(session, machine, "debian-12", "wwn=0x5000c500a1b2c3d4", by="alice",
         reason="ticket 4711")
    assert withdraw(session, machine, by="bob", reason="wrong rack")
    assert not withdraw(session, machine, by="bob", reason="again")  # nothing pending
    assert installation_history(db, machine) == [
        ("Wanted", "image debian-12 on disk wwn=0x5000c500a1b2c3d4, asked by alice: "
                   "ticket 4711"),
        ("Withdrawn", "withdrawn by bob: wrong rack"),
    ]


# -- part 2: steps, the backlogs while installing, quarantine ----------------------------


def test_a_tried_installation_stays_in_the_backlog_without_an_agent(db, session):
    """A first installation waits for an agent; once one was tried (generation > 0), the
    machine is in the backlog whatever its agent does: after a failed reboot it may run
    none, and the workflow boots the rescue system itself."""
    first, tried = seed_provided(session, 2)
    want(session, first)
    want(session, tried)
    assert backlog_ids(session, OS_INSTALL) == set()
    generation = dispatch(session, tried)
    settle(session, tried, generation, installed=False)
    assert backlog_ids(session, OS_INSTALL) == {tried}


def test_a_machine_between_installation_steps_is_not_silent_by_accident(db, session):
    """Recovery's backlog and the guard's silent count leave out a machine whose
    installation is at a step (it reboots on purpose); once settled, it counts again."""
    installing, hung = heard(session, 2, ago=45)
    want(session, installing)
    generation = dispatch(session, installing)
    assert installing not in backlog_ids(session, Process.RECOVERY)
    assert hung in backlog_ids(session, Process.RECOVERY)
    silent = db.read(lambda tx: bmdb.silent_machines(tx, db.thresholds))
    assert silent == 1
    session.transact(lambda tx: bmdb.advance_installation(tx, installing, generation,
                                                          "rebooting"))
    assert installing not in backlog_ids(session, Process.RECOVERY)
    settle(session, installing, generation, installed=False)
    assert installing in backlog_ids(session, Process.RECOVERY)
    assert db.read(lambda tx: bmdb.silent_machines(tx, db.thresholds)) == 2
    # A rescue boot before any dispatch: its step is ended by the work that set it.
    session.transact(lambda tx: bmdb.advance_installation(tx, hung, 0, "rescue"))
    assert hung in backlog_ids(session, Process.RECOVERY)  # no wish: nothing set
    want(session, hung)
    session.transact(lambda tx: bmdb.advance_installation(tx, hung, 0, "rescue"))
    assert hung not in backlog_ids(session, Process.RECOVERY)
    session.transact(lambda tx: bmdb.end_installation_steps(tx, hung))
    assert hung in backlog_ids(session, Process.RECOVERY)


def test_steps_are_recorded_for_the_current_generation_only(db, session):
    (machine,) = heard(session)
    want(session, machine)
    generation = dispatch(session, machine)
    wish = session.transact(lambda tx: bmdb.installation_of(tx, machine)).wanted
    assert wish is not None and (wish.step, wish.generation) == ("writing", generation)
    assert session.transact(lambda tx: bmdb.advance_installation(
        tx, machine, generation, "boot_device"))
    assert not session.transact(lambda tx: bmdb.advance_installation(
        tx, machine, generation + 1, "rebooting"))
    with pytest.raises(ValueError, match="no installation step 'dancing'"):
        session.transact(lambda tx: bmdb.advance_installation(tx, machine, generation,
                                                              "dancing"))
    wish = session.transact(lambda tx: bmdb.installation_of(tx, machine)).wanted
    assert wish is not None and wish.step == "boot_device" and wish.step_at is not None
    session.transact(lambda tx: bmdb.close_installation_request(tx, machine, generation))
    assert session.transact(lambda tx: bmdb.installation_of(tx, machine)).in_flight is None
    session.transact(lambda tx: bmdb.settle_installation(
        tx, machine, generation, "installed", target=("debian-12", "serial=S1")))
    wish = session.transact(lambda tx: bmdb.installation_of(tx, machine)).wanted
    assert wish is not None and (wish.outcome, wish.step, wish.step_at) == ("installed",
                                                                             None, None)


def test_failed_installations_in_a_row_quarantine_and_a_cancel_breaks_no_streak(db, session):
    (machine,) = heard(session)

    def outcome(event: bmdb.Event, cause: str) -> bool:
        def body(tx: bmdb.Tx) -> bool:
            bmdb.record_history(tx, machine, OS_INSTALL.value, event, cause)
            return bmdb.quarantine_if_due(tx, machine, 2, "test", bmdb.INSTALLATIONS_FAILED)
        return session.transact(body)

    assert not outcome(bmdb.Event.FAILED, "taking_over: no SSH banner")
    assert not outcome(bmdb.Event.FINISHED, "")
    assert not outcome(bmdb.Event.FAILED, "boot_device: read back as network")
    assert not outcome(bmdb.Event.CANCELED, "withdrawn")  # neither a failure nor a success
    # Recovery's ladders are another streak: their failures do not count here.
    session.transact(lambda tx: bmdb.record_history(tx, machine, Process.RECOVERY.value,
                                                    bmdb.Event.FAILED, "ladder exhausted"))
    assert outcome(bmdb.Event.FAILED, "first_heartbeat: no marker")
    holds = session.transact(lambda tx: bmdb.holds_of(tx, machine))
    assert [(h.kind, h.reason) for h in holds] == [
        ("quarantine", "an installation failed 2 times in a row")]


def test_a_host_key_hold_keeps_agents_out_but_lets_a_wanted_installation_resolve_it(
        db, session):
    """A host-key mismatch holds the machine out of AgentStart and Recovery, not out of
    an installation the operator asked for: that installation writes and pins a key of
    its own, which lifts the hold. Maintenance still keeps the installation out."""
    (machine,) = heard(session, ago=45)
    want(session, machine)
    generation = dispatch(session, machine)
    settle(session, machine, generation, installed=False)  # failed: generation > 0
    session.transact(lambda tx: bmdb.put_hold(
        tx, machine, bmdb.HOST_KEY_HOLD, "SSH presented another key", "ShepherdRecovery",
        host_key="ssh-ed25519 AAAA seen"))
    assert machine not in backlog_ids(session, Process.RECOVERY)
    assert machine in backlog_ids(session, OS_INSTALL)
    session.transact(lambda tx: bmdb.put_hold(tx, machine, bmdb.MAINTENANCE, "cabling", "bob"))
    assert machine not in backlog_ids(session, OS_INSTALL)
    session.transact(lambda tx: bmdb.lift_hold(tx, machine, bmdb.MAINTENANCE, "bob"))

    again = dispatch(session, machine)
    session.transact(lambda tx: bmdb.pin_installed_host_key(
        tx, machine, "ssh-ed25519 AAAA chosen", "SHA256:chosen", again))
    assert db.read(lambda tx: bmdb.holds_of(tx, machine)) == []
    lifted = [h for h in db.read(lambda tx: bmdb.machine_history(tx, machine))
              if h["process"] == "HostKey" and h["event"] == "Released"]
    assert lifted and lifted[0]["cause"] == (f"by installation generation {again}: it "
                                             "pinned a key of its own")
