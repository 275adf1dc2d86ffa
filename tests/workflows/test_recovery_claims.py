"""The guard decided once (``guard.decide`` in a caller's transaction is ``evaluate``), and
Recovery claimed only under its hold, after the guard (``recovery_claims``), on
PostgreSQL and SQLite against the seeded operator fleet (5 agents started, 3 silent,
2 Recovery claims this hour)."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid

import pytest

import bmdb
from shepherd.workflows import guard, recovery_claims
from shepherd.workflows.guard import GuardDecision, GuardLimits
from shepherd.workflows.recovery_claims import (
    RECOVERY_CLAIMS,
    ClaimsBusy,
    RecoveryPaused,
    claim_recovery,
)
from tests.support.operator_fixtures import Fleet, healthy_callback_server, seed_fleet

PAUSING = GuardLimits()  # 60 % silent > 10 %
ALLOWING = GuardLimits(max_share=1.0, reboots_per_hour=5)


@pytest.fixture
def fleet(db: bmdb.BMDB, session: bmdb.Session) -> Fleet:
    return seed_fleet(db, session)


def recovery_work(db: bmdb.BMDB) -> int:
    return db.read(lambda tx: bmdb.active_work(tx, bmdb.Process.RECOVERY))


# -- one guard evaluation ---------------------------------------------------------------


@pytest.mark.parametrize("limits", [PAUSING, ALLOWING, GuardLimits(reboots_per_hour=2)],
                         ids=["share", "allows", "budget"])
@pytest.mark.parametrize("budget", [True, False])
def test_decide_in_a_callers_transaction_is_evaluate(db: bmdb.BMDB, fleet: Fleet,
                                                     limits: GuardLimits, budget: bool) -> None:
    """The decision a caller takes inside its own read (as ``explain`` does) is the one
    ``evaluate`` takes, and it carries the limits it was decided against."""
    with healthy_callback_server() as endpoint:
        limits = dataclasses.replace(limits, healthz_url=f"{endpoint}/healthz")
        evaluated = guard.evaluate(db, db.thresholds, limits, budget=budget)
        callback = guard.check_callback(limits)
        assert callback == guard.CallbackCheck(f"{endpoint}/healthz", None)

        def read(tx: bmdb.Tx) -> tuple[GuardDecision, bool]:
            decided = guard.decide(tx, db.thresholds, limits, callback, budget=budget)
            return decided, bmdb.machine_exists(tx, fleet.silent)

        decided, exists = db.read(read)
    assert exists
    assert decided == evaluated
    assert (decided.started, decided.silent, decided.reboots_last_hour) == (5, 3, 2)
    assert (decided.max_share, decided.min_silent, decided.reboots_per_hour,
            decided.callback_url, decided.callback_healthy) == (
        limits.max_share, limits.min_silent, limits.reboots_per_hour, f"{endpoint}/healthz",
        True)
    assert decided.allowed == max(0, limits.reboots_per_hour - 2)
    expected = set()
    if limits.max_share < 0.6:
        expected.add(guard.SILENT_SHARE)
    if budget and limits.reboots_per_hour <= 2:
        expected.add(guard.REBOOT_BUDGET)
    assert set(decided.causes) == expected
    assert (decided.paused is None) == (not expected)


def test_decide_without_a_callback_check_does_not_judge_the_server(db: bmdb.BMDB,
                                                                   fleet: Fleet) -> None:
    decided = db.read(lambda tx: guard.decide(tx, db.thresholds, ALLOWING, None))
    assert decided.callback_healthy is None and decided.callback_url is None
    assert decided.paused is None and decided.allowed == 3
    unhealthy = guard.CallbackCheck("http://callbacks.invalid/healthz", "callback server down")
    decided = db.read(lambda tx: guard.decide(tx, db.thresholds, ALLOWING, unhealthy))
    assert decided.causes == (guard.CALLBACK_SERVER,)
    assert decided.paused == "recovery paused: callback server down"
    assert decided.to_json()["callback_healthy"] is False


# -- Recovery claimed under its hold, after the guard -------------------------------------


def test_paused_claims_nothing(db: bmdb.BMDB, session: bmdb.Session, fleet: Fleet) -> None:
    before = recovery_work(db)
    asked: list[int] = []
    seen: list[GuardDecision] = []

    def claim(allowed: int) -> list[bmdb.Work]:
        asked.append(allowed)
        return session.claim_backlog(bmdb.Process.RECOVERY, allowed)

    with pytest.raises(RecoveryPaused, match="3 of 5 started agents are silent") as paused:
        claim_recovery(session, db.thresholds, PAUSING, claim, on_decision=seen.append)
    assert paused.value.decision.causes == (guard.SILENT_SHARE,)
    assert seen == [paused.value.decision]
    assert asked == [] and recovery_work(db) == before
    # The hold was given back: the next claimer gets it at once.
    with bmdb.hold_singleton(session, RECOVERY_CLAIMS) as held:
        assert held


def test_allowed_claims_within_the_budget_under_the_hold(db: bmdb.BMDB, session: bmdb.Session,
                                                         fleet: Fleet) -> None:
    holders: list[uuid.UUID | None] = []

    def claim(allowed: int) -> list[bmdb.Work]:
        holders.append(db.read(lambda tx: holder_of(tx, RECOVERY_CLAIMS)))
        return session.claim_backlog(bmdb.Process.RECOVERY, allowed, dispatch_ttl=30)

    claimed = claim_recovery(session, db.thresholds, GuardLimits(max_share=1.0,
                                                                reboots_per_hour=3), claim)
    assert holders == [session.id]  # claimed while holding
    assert len(claimed) == 1  # 3 per hour, 2 spent: one more
    assert {w.machine_id for w in claimed} <= {fleet.silent, fleet.quiet}
    for work in claimed:
        work.cancel("test")


def holder_of(tx: bmdb.Tx, name: str) -> uuid.UUID | None:
    """The session holding ``name``, read straight from the table (asking through
    ``try_acquire`` would take it)."""
    return tx.execute(
        bmdb._schema.singletons.select().with_only_columns(bmdb._schema.singletons.c.session_id)
        .where(bmdb._schema.singletons.c.name == name)).scalar_one_or_none()


def test_a_busy_hold_raises_claims_busy_after_waiting(db: bmdb.BMDB, session: bmdb.Session,
                                                     fleet: Fleet) -> None:
    with db.start_session("other-claimer", interval=30) as other, \
            bmdb.hold_singleton(other, RECOVERY_CLAIMS) as held:
        assert held

        def claim(allowed: int) -> list[bmdb.Work]:
            raise AssertionError("must not claim without the hold")

        started = time.monotonic()
        with pytest.raises(ClaimsBusy):
            claim_recovery(session, db.thresholds, ALLOWING, claim, wait=0.5)
        assert time.monotonic() - started >= 0.5
        with pytest.raises(ClaimsBusy):  # no wait: one try
            claim_recovery(session, db.thresholds, ALLOWING, claim)


def test_a_waiting_claimer_gets_the_hold_once_released(db: bmdb.BMDB, session: bmdb.Session,
                                                      fleet: Fleet) -> None:
    other = db.start_session("other-claimer", interval=30)
    released = threading.Event()

    def hold_briefly() -> None:
        with bmdb.hold_singleton(other, RECOVERY_CLAIMS):
            released.wait(5)

    holder = threading.Thread(target=hold_briefly)
    holder.start()
    try:
        while db.read(lambda tx: holder_of(tx, RECOVERY_CLAIMS)) != other.id:
            time.sleep(0.05)
        threading.Timer(0.5, released.set).start()
        assert claim_recovery(session, db.thresholds, ALLOWING, lambda allowed: [],
                              wait=10) == []
    finally:
        released.set()
        holder.join(5)
        other.close()


def test_recovery_paused_is_the_operators() -> None:
    from shepherd import operations

    assert operations.RecoveryPaused is recovery_claims.RecoveryPaused
    assert not hasattr(operations, "RECOVERY_CLAIMS")
